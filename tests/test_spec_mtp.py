"""The MTP drafter (engine.speculation.mtp): the tiny Qwen3.5-style checkpoint with mtp.* weights,
loading them beside mlx-lm's model, the module's forward, and the source's KV bookkeeping
(entries == target positions, drafts trimmed on commit, capture/restore)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.engine.generate import SamplingParams
from mlxkv.engine.models import load_model
from mlxkv.engine.speculation.base import KVState, TargetView
from mlxkv.engine.speculation.mtp import _copy_cache, load_mtp_provider
from mlxkv.engine.speculation.mtp_weights import MTPWeights, MTPWeightsError, build_mtp_module, read_mtp_weights
from support.modelgen import mtp_model, tiny_model

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hybrid():
    loaded = load_model(mtp_model())
    return loaded, load_mtp_provider(loaded)


@pytest.fixture(scope="module")
def target(hybrid):
    """The model, its provider and its TargetView. The tests feed the target only tokens
    it keeps, so its recurrent layers never need a rollback."""
    loaded, provider = hybrid
    return loaded, provider, TargetView(loaded.model, loaded.tokenizer)


def _stored(path: Path) -> dict:
    return {k: v for k, v in mx.load(str(path / "model.safetensors")).items() if k.startswith("mtp.")}


def test_checkpoint_has_mtp_layout_and_mlx_lm_drops_it(hybrid):
    loaded, provider = hybrid
    stored = _stored(loaded.path)
    hidden = json.loads((loaded.path / "config.json").read_text())["text_config"]["hidden_size"]
    assert stored["mtp.fc.weight"].shape == (hidden, 2 * hidden)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert stored[f"mtp.{name}.weight"].shape == (hidden,)
    assert "mtp.layers.0.self_attn.q_proj.weight" in stored and "mtp.layers.0.mlp.up_proj.weight" in stored
    from mlx.utils import tree_flatten

    names = [k for k, _ in tree_flatten(loaded.model.parameters())]
    assert names and not any("mtp" in k for k in names)
    # mlx-lm made the trunk's zero-centred norms 1 + w (the builder stored w = 0)
    assert mx.allclose(loaded.model.language_model.model.norm.weight, mx.ones((hidden,))).item()
    assert provider is not None and provider.kind == "mtp" and provider.needs_hidden


def test_no_mtp_weights_no_provider():
    assert load_mtp_provider(load_model(tiny_model("qwen3"))) is None


def test_mtp_norms_are_one_plus_w_and_fc_kept(hybrid):
    loaded, provider = hybrid
    stored, module = _stored(loaded.path), provider.module
    for name, norm in (("pre_fc_norm_embedding", module.pre_fc_norm_embedding),
                       ("pre_fc_norm_hidden", module.pre_fc_norm_hidden), ("norm", module.norm),
                       ("layers.0.input_layernorm", module.layers[0].input_layernorm),
                       ("layers.0.self_attn.q_norm", module.layers[0].self_attn.q_norm)):
        assert mx.allclose(norm.weight, 1.0 + stored[f"mtp.{name}.weight"]).item(), name
    assert mx.array_equal(module.fc.weight, stored["mtp.fc.weight"]).item()


def test_forward_is_fc_of_embedding_then_hidden(hybrid):
    """z = fc([rms(e)(1+w_e), rms(h)(1+w_h)]) -> layer -> rms(.)(1+w_n), embedding first."""
    from mlx_lm.models.cache import KVCache

    loaded, provider = hybrid
    stored, module = _stored(loaded.path), provider.module
    mx.random.seed(3)
    e, h = mx.random.normal((1, 5, 64)), mx.random.normal((1, 5, 64))

    def rms(x, w):
        return mx.fast.rms_norm(x, 1.0 + stored[f"mtp.{w}.weight"], 1e-6)

    def reference(first, second):
        z = mx.concatenate([first, second], axis=-1) @ stored["mtp.fc.weight"].T
        return rms(module.layers[0](z, mask="causal", cache=KVCache()), "norm")

    got = module(e, h, [KVCache()])
    want = reference(rms(e, "pre_fc_norm_embedding"), rms(h, "pre_fc_norm_hidden"))
    swapped = reference(rms(h, "pre_fc_norm_hidden"), rms(e, "pre_fc_norm_embedding"))
    assert mx.allclose(got, want, atol=1e-5).item()
    assert not mx.allclose(got, swapped, atol=1e-3).item()


def test_sidecar_weights_load_with_the_same_fingerprint(hybrid):
    loaded = load_model(mtp_model(sidecar=True))
    assert (loaded.path / "mtp.safetensors").exists()
    assert not any(k.startswith("mtp.") for k in mx.load(str(loaded.path / "model.safetensors")))
    provider = load_mtp_provider(loaded)
    assert provider.checkpoint_namespace() == hybrid[1].checkpoint_namespace()
    assert provider.files == ["mtp.safetensors"]


def test_malformed_mtp_weights_are_refused_clearly(hybrid, tmp_path):
    loaded, _ = hybrid
    good = read_mtp_weights(loaded.path)

    def build(tensors, model_type="qwen3_5"):
        return build_mtp_module(loaded.model, model_type, dataclasses.replace(good, tensors=tensors), mx.float32)

    without = {k: v for k, v in good.tensors.items() if k != "norm.weight"}
    with pytest.raises(MTPWeightsError, match="missing mtp.norm.weight"):
        build(without)
    with pytest.raises(MTPWeightsError, match=r"mtp.fc.weight has shape \(64, 64\)"):
        build({**good.tensors, "fc.weight": mx.zeros((64, 64))})
    with pytest.raises(MTPWeightsError, match="2 MTP layers"):
        build({**good.tensors, "layers.1.input_layernorm.weight": mx.zeros((64,))})
    with pytest.raises(MTPWeightsError, match="'qwen3'"):
        build(good.tensors, model_type="qwen3")
    with pytest.raises(MTPWeightsError, match=r"quantized \(mtp.fc.scales\)"):
        build({**good.tensors, "fc.scales": mx.zeros((64, 2))})
    with pytest.raises(MTPWeightsError, match="unexpected mtp.fc.bias"):
        build({**good.tensors, "fc.bias": mx.zeros((64,))})
    folder = tmp_path / "model"
    shutil.copytree(loaded.path, folder)
    (folder / "mtp-extra.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(MTPWeightsError, match="damaged safetensors header"):
        load_mtp_provider(dataclasses.replace(loaded, path=folder))
    assert isinstance(MTPWeightsError("x"), ValueError) and isinstance(good, MTPWeights)
    # Through the loader the message names the file.
    sidecar = tmp_path / "sidecar"
    sidecar.mkdir()
    (sidecar / "config.json").write_text((loaded.path / "config.json").read_text())
    bad = {f"mtp.{k}": v for k, v in good.tensors.items()}
    bad["mtp.fc.weight"] = mx.zeros((64, 64))
    mx.save_safetensors(str(sidecar / "mtp.safetensors"), bad)
    with pytest.raises(MTPWeightsError, match=r"mtp.safetensors: mtp.fc.weight has shape \(64, 64\)"):
        load_mtp_provider(dataclasses.replace(loaded, path=sidecar))


def _prompt(loaded, text="def mtp(x):\n    return x + 1\n"):
    return list(loaded.tokenizer.encode(text))


def test_source_keeps_one_entry_per_target_position(target):
    loaded, provider, view = target
    prompt = _prompt(loaded)
    cache = loaded.model.make_cache()
    _, hidden = view.forward(mx.array([prompt]), cache)
    src = provider.open(view, GREEDY)
    src.prefill(prompt, 0, hidden[0])
    assert src.tokens == len(prompt) == src.kv_entries
    # Depth d + 1 feeds back the MTP's own output hidden with draft d.
    mtp, head, manual = provider.module, view.logits, src.capture().cache
    g = mtp(view.embed(mx.array([[7]])), hidden[:, -1:], manual)
    want = []
    for _ in range(3):
        want.append(int(mx.argmax(head(g)[0, -1]).item()))
        g = mtp(view.embed(mx.array([[want[-1]]])), g, manual)
    assert src.kv_entries == len(prompt)  # capture ran them
    proposal = src.propose(7, 3)
    assert proposal.tokens == want
    assert len(proposal.tokens) == 3 and proposal.probs is None
    assert src.kv_entries == len(prompt) + 3  # pending's entry + two fed-back drafts
    accepted = [7, proposal.tokens[0]]
    _, rows = view.forward(mx.array([accepted]), cache)
    src.commit(accepted, rows[0])
    assert src.kv_entries == len(prompt) + 1  # drafts trimmed; the draft's real entry waits
    assert src.tokens == len(prompt) + 2
    state = src.capture()
    assert isinstance(state, KVState)
    assert state.tokens == prompt + accepted and state.cache[0].offset == len(state.tokens)
    assert src.propose(5, 0).tokens == []
    with pytest.raises(ValueError, match="hidden rows"):
        src.commit([1, 2], rows[0, :1])


def _rounds(loaded, view, src, prompt, plan):
    """Drive ``src`` as a verifier would, keeping the first ``a`` drafts of each round
    (None: a plain step without a proposal). Returns (tokens in the target, next pending)."""
    cache = loaded.model.make_cache()
    _, hidden = view.forward(mx.array([prompt]), cache)
    src.prefill(prompt, 0, hidden[0])
    tokens, pending = list(prompt), 11
    for a in plan:
        drafts = [] if a is None else src.propose(pending, 3).tokens
        fed = [pending] + drafts[: a or 0]
        _, rows = view.forward(mx.array([fed]), cache)
        src.commit(fed, rows[0])
        tokens += fed
        pending = (pending * 7 + 3) % 500
    return tokens, pending


def test_incremental_rounds_equal_one_prefill_of_everything(target):
    loaded, provider, view = target
    prompt = _prompt(loaded)
    src = provider.open(view, GREEDY)
    tokens, pending = _rounds(loaded, view, src, prompt, [0, 3, None, 1, 2, None, None, 3, 0])
    _, hidden = view.forward(mx.array([tokens]), loaded.model.make_cache())
    full = provider.open(view, GREEDY)
    full.prefill(tokens, 0, hidden[0])
    a, b = src.capture(), full.capture()
    assert a.tokens == b.tokens == tokens
    assert mx.allclose(a.cache[0].keys, b.cache[0].keys, atol=1e-4).item()
    assert mx.allclose(a.cache[0].values, b.cache[0].values, atol=1e-4).item()
    assert src.propose(pending, 4).tokens == full.propose(pending, 4).tokens


def test_capture_restore_round_trip_and_shorter_prefix(target):
    loaded, provider, view = target
    prompt = _prompt(loaded)
    src = provider.open(view, GREEDY)
    tokens, pending = _rounds(loaded, view, src, prompt, [2, None, 3])
    state = src.capture()
    again = provider.open(view, GREEDY)
    again.restore(state)
    # The restored source does not know the last position's hidden (a KVState holds only
    # KV), so compare it with the original after both took the same next prompt.
    turn = _prompt(loaded, "\nprint(mtp(2))\n")
    _, rows = view.forward(mx.array([tokens + turn]), loaded.model.make_cache())
    again.prefill(tokens + turn, len(tokens), rows[0, len(tokens):])
    assert again.capture().tokens == tokens + turn and again.kv_entries == len(tokens) + len(turn)
    first = again.propose(pending, 4).tokens
    assert len(first) == 4
    # The prefix cache may hand back a shorter prefix of a stored state (tail reuse).
    k = len(prompt) - 3
    short = KVState(tokens=state.tokens[:k], cache=_copy_cache(state.cache, k))
    other = provider.open(view, GREEDY)
    other.restore(short)
    other.prefill(tokens + turn, len(tokens), rows[0, len(tokens):])  # positions k.. have no hidden
    assert other.capture().tokens == tokens + turn and other.kv_entries == len(tokens) + len(turn)
    # ... and a restored state longer than (or different from) the prompt is cut back.
    third = provider.open(view, GREEDY)
    third.restore(state)
    _, prow = view.forward(mx.array([prompt]), loaded.model.make_cache())
    third.prefill(prompt, 4, prow[0, 4:])
    assert third.capture().tokens == prompt
    with pytest.raises(ValueError, match="entries for"):
        third.restore(KVState(tokens=state.tokens[:2], cache=state.cache))
    with pytest.raises(ValueError, match="not an MTP state"):
        third.restore({"tokens": []})


def test_sampled_drafts_return_their_distribution(target):
    loaded, provider, view = target
    prompt = _prompt(loaded)
    _, hidden = view.forward(mx.array([prompt]), loaded.model.make_cache())
    src = provider.open(view, SamplingParams(temperature=0.8, seed=1))
    src.prefill(prompt, 0, hidden[0])
    proposal = src.propose(3, 3)
    vocab = view.logits(hidden).shape[-1]
    assert proposal.probs.shape == (3, vocab)
    assert mx.allclose(proposal.probs.sum(axis=-1), mx.ones((3,)), atol=1e-4).item()
    assert all(proposal.probs[i, t].item() > 0 for i, t in enumerate(proposal.tokens))


def test_queued_entries_are_bounded(target, monkeypatch):
    import mlxkv.engine.speculation.mtp as mtp

    loaded, provider, view = target
    prompt = _prompt(loaded)
    _, hidden = view.forward(mx.array([prompt]), loaded.model.make_cache())
    monkeypatch.setattr(mtp, "QUEUE_MAX", 4)
    src = provider.open(view, GREEDY)
    src.prefill(prompt[:3], 0, hidden[0, :3])
    assert src.kv_entries == 3
    src.commit(prompt[3:5], hidden[0, 3:5])  # plain steps queue their entries ...
    assert src.kv_entries == 3 and src.tokens == 5
    src.commit(prompt[5:7], hidden[0, 5:7])  # ... up to the bound, then they run
    assert src.kv_entries == 7 == src.tokens


def test_target_view_gives_the_models_own_logits_and_post_norm_hidden(target):
    """The MTP shares the LM head through the view, and reads the hidden after the final
    norm (what the head consumes); qwen3_5 keeps its untied head on language_model."""
    loaded, _, view = target
    tokens = mx.array([_prompt(loaded)])
    logits, hidden = view.forward(tokens, loaded.model.make_cache())
    assert mx.allclose(logits, loaded.model(tokens, cache=loaded.model.make_cache()), atol=1e-4).item()
    assert mx.allclose(hidden, loaded.model.language_model.model(tokens, cache=loaded.model.make_cache()),
                       atol=1e-5).item()
    assert not loaded.config["text_config"]["tie_word_embeddings"]


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}


def test_moe_mtp_layer_from_fused_or_per_expert_weights():
    """Qwen3.5-MoE ships the MTP layer's experts fused (experts.gate_up_proj, down_proj),
    Qwen3-Next one tensor per expert: both fill mlx-lm's stacked switch_mlp."""
    loaded = load_model(mtp_model(**MOE))
    assert loaded.config["model_type"] == "qwen3_5_moe"
    provider = load_mtp_provider(loaded)
    weights = read_mtp_weights(loaded.path)
    fused = weights.tensors["layers.0.mlp.experts.gate_up_proj"]
    switch = provider.module.layers[0].mlp.switch_mlp
    assert mx.array_equal(switch.gate_proj.weight, fused[:, :32, :]).item()
    assert mx.array_equal(switch.up_proj.weight, fused[:, 32:, :]).item()
    per_expert = {k: v for k, v in weights.tensors.items() if ".experts." not in k}
    down = weights.tensors["layers.0.mlp.experts.down_proj"]
    for e in range(4):
        per_expert[f"layers.0.mlp.experts.{e}.gate_proj.weight"] = fused[e, :32, :]
        per_expert[f"layers.0.mlp.experts.{e}.up_proj.weight"] = fused[e, 32:, :]
        per_expert[f"layers.0.mlp.experts.{e}.down_proj.weight"] = down[e]
    module = build_mtp_module(loaded.model, "qwen3_5_moe", dataclasses.replace(weights, tensors=per_expert),
                              mx.float32)
    assert mx.array_equal(module.layers[0].mlp.switch_mlp.up_proj.weight, switch.up_proj.weight).item()
    del per_expert["layers.0.mlp.experts.3.down_proj.weight"]
    with pytest.raises(MTPWeightsError, match="lack mtp.layers.0.mlp.experts.3.down_proj.weight"):
        build_mtp_module(loaded.model, "qwen3_5_moe", dataclasses.replace(weights, tensors=per_expert), mx.float32)


def test_restored_entries_past_the_targets_cached_prefix_are_kept(target):
    """A hybrid target restores only at exact positions, so it may recompute a prompt
    whose MTP state came back longer: the restored entries stay (not run again) and the
    next entry reads the hidden row the target just computed."""
    from mlx_lm.models.cache import KVCache

    loaded, provider, view = target
    prompt = _prompt(loaded)
    _, hidden = view.forward(mx.array([prompt]), loaded.model.make_cache())
    full = provider.open(view, GREEDY)
    full.prefill(prompt, 0, hidden[0])
    state = full.capture()
    k = len(prompt) - 4
    marked = KVCache()
    marked.keys = mx.zeros_like(state.cache[0].keys[..., :k, :])
    marked.values = mx.zeros_like(state.cache[0].values[..., :k, :])
    marked.offset = k
    src = provider.open(view, GREEDY)
    src.restore(KVState(tokens=prompt[:k], cache=[marked]))
    src.prefill(prompt, 0, hidden[0])
    keys = src.capture().cache[0].keys
    assert keys.shape[2] == len(prompt)
    assert not mx.any(keys[..., :k, :]).item()  # kept as restored
    assert mx.allclose(keys[..., k:, :], state.cache[0].keys[..., k:, :], atol=1e-5).item()


def test_commit_without_hidden_keeps_the_cache_aligned(target):
    """A step the verifier ran without hidden rows (a plain step of a source-blind fast path)
    leaves zero-hidden entries: the cache still holds one entry per position and drafting
    goes on."""
    loaded, provider, view = target
    prompt = _prompt(loaded)
    cache = loaded.model.make_cache()
    _, hidden = view.forward(mx.array([prompt]), cache)
    src = provider.open(view, GREEDY)
    src.prefill(prompt, 0, hidden[0])
    src.commit([5])
    src.commit([6, 7])
    assert len(src.propose(8, 2).tokens) == 2
    _, rows = view.forward(mx.array([[5, 6, 7, 8]]), cache)
    src.commit([8], rows[0, 3:])
    state = src.capture()
    assert state.tokens == prompt + [5, 6, 7, 8] and state.cache[0].offset == len(prompt) + 4


def test_grouped_rows_hand_mtp_rows_tokens_they_did_not_propose(target):
    from mlxkv.engine.speculation.rows import SourceRowGroup

    loaded, provider, view = target
    prompt = _prompt(loaded)
    _, hidden = view.forward(mx.array([prompt]), loaded.model.make_cache())
    rows = []
    for _ in range(2):
        src = provider.open(view, GREEDY)
        src.prefill(prompt, 0, hidden[0])
        rows.append(src)
    group = SourceRowGroup()
    group.append(rows)
    proposals = group.propose([3, 4], 2)
    assert [len(p) for p in proposals] == [2, 2]
    group.commit([[3, proposals[0][0]], [4]])
    group.consume([[9, 10, 11], [12]], [3, 1])
    assert provider.supports_external_tokens
    assert rows[0].capture().tokens == prompt + [3, proposals[0][0], 9, 10, 11]
    assert rows[1].capture().tokens == prompt + [4, 12]
    assert group.capture(1).cache[0].offset == len(prompt) + 2
