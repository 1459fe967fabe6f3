"""The order of a batch step's work on a real tiny model: rows that end in the same step
have their state stored only once every row's tokens of that step are sent, so a store
(hashing and copying a row's KV state) never holds back the tokens of the rows beside it."""

import random
import threading

from common import T

from mlxkv.engine.cache.prefix_cache import PrefixCache
from mlxkv.engine.engine import Engine, Request, TokenEvent
from mlxkv.engine.generate import SamplingParams


class RecordingCache(PrefixCache):
    """A real RAM prefix cache that notes, in one shared log, when a state is stored."""

    def __init__(self, log: list):
        super().__init__(ram_bytes=64 << 20, cache_dir=None, block_tokens=16)
        self.log = log

    def store(self, tokens, cache, ns, session=None, retain_s=None):
        self.log.append(("store", len(tokens)))
        return super().store(tokens, cache, ns, session=session, retain_s=retain_s)


def test_rows_ending_together_send_their_tokens_before_any_store(tiny_qwen3):
    log: list = []
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(12 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                            repetition_penalty=1.0, max_tokens=6)
    with Engine(str(tiny_qwen3), prefix_cache=RecordingCache(log), max_batch=8).start(timeout=T) as e:
        gate = threading.Event()
        busy = e.call(gate.wait, T)  # all three wait together, then start in one batch
        handles = [e.submit(Request(prompt_tokens=p, params=params),
                            callback=lambda ev, i=i: log.append(("token", i))
                            if isinstance(ev, TokenEvent) and ev.token is not None else None)
                   for i, p in enumerate(prompts)]
        gate.set()
        busy.result(timeout=T)
        results = [h.result(timeout=T) for h in handles]
    assert all(r.stats.batched and len(r.tokens) == 6 for r in results)
    stores = [i for i, x in enumerate(log) if x[0] == "store"]
    last_tokens = [max(i for i, x in enumerate(log) if x == ("token", k)) for k in range(3)]
    assert len(stores) == 3
    assert max(last_tokens) < min(stores)
