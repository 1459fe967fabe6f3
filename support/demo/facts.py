"""What the demo model knows: facts about mlxkv as question variants and answer phrasings.

Each fact's first question is its canonical phrasing (the README's sample questions are
among them); the others are paraphrases, terse and lower-case ones too, as people type
them. Its first answer is the canonical answer, the one the model is trained to give to
every phrasing; the other phrasings only appear as earlier turns of a conversation (see
corpus.py). Taken from the project's design notes; keep them true when the project changes.
"""

from __future__ import annotations

FACTS: list[dict] = [
    {  # what is mlxkv
        "q": [
            "What is mlxkv?",
            "What does mlxkv do?",
            "Tell me about mlxkv.",
            "Can you explain what mlxkv is?",
            "What is this project?",
            "What is mlxkv for?",
            "Describe mlxkv in one sentence.",
            "What kind of software is mlxkv?",
            "Give me a short overview of mlxkv.",
            "What is this engine?",
            "Why would I use mlxkv?",
            "What problem does mlxkv solve?",
            "what's mlxkv",
            "mlxkv?",
            "what is mlxkv",
            "explain mlxkv",
            "whats mlxkv",
            "What is mlxkv exactly?",
            "so what is mlxkv",
        ],
        "a": [
            "mlxkv is a local LLM engine on MLX whose long prompts come back instantly. It keeps "
            "the KV cache of every conversation in a tiered prefix cache, in RAM and on the SSD, "
            "so a shared prefix is computed once and reused, even after a restart.",
            "mlxkv is a local engine for running language models with MLX. Its main feature is a "
            "tiered prefix cache: the KV state of each conversation is kept in RAM and on the SSD "
            "in hash-chained token blocks, so long prompts do not have to be computed again.",
            "mlxkv runs language models locally on MLX and remembers the KV cache of every "
            "conversation in RAM and on the SSD. When a prompt starts with a prefix it has seen "
            "before, mlxkv restores that prefix instead of computing it again.",
        ],
    },
    {  # SSD cache
        "q": [
            "How does the SSD cache work?",
            "How does the SSD tier work?",
            "What is the SSD tier?",
            "How does mlxkv store the cache on disk?",
            "Where is the KV cache saved on disk?",
            "Does the cache survive a restart?",
            "How does the disk cache work?",
            "What happens to the cache when I restart mlxkv?",
            "How is the KV cache persisted?",
            "Explain the SSD cache.",
            "What does the SSD tier store?",
            "how does the ssd cache work",
            "ssd cache?",
            "how does the cache on the ssd work",
            "explain the ssd cache",
            "how does caching to disk work",
            "how does the SSD cache work",
        ],
        "a": [
            "The SSD tier writes the KV cache to disk in token blocks of 256 tokens. A writer "
            "thread saves each block in the background after a turn, and every block is checked "
            "against its content hash when it is read back, so after a restart a long "
            "conversation is restored from the SSD instead of being computed again.",
            "mlxkv cuts the KV cache into blocks of 256 tokens and writes each block to a file on "
            "the SSD in the background. The files survive a restart. When a prompt starts with a "
            "cached prefix, the reader thread loads the blocks and verifies their hash, so the "
            "prefix is restored in a fraction of a second.",
            "The SSD tier is the part of the prefix cache that lives on disk. Blocks of KV state "
            "are written atomically by a writer thread and verified with a content hash on every "
            "read, so the cache survives restarts and a damaged block is never restored.",
        ],
    },
    {  # tests
        "q": [
            "How do I run the tests?",
            "How can I run the test suite?",
            "How do I test mlxkv?",
            "What command runs the tests?",
            "How do I run pytest for mlxkv?",
            "How do I check that everything works?",
            "Which command runs the unit tests?",
            "How are the tests run?",
            "How do I run the tests on a fresh clone?",
            "how do i run tests",
            "how to run the tests",
            "run the tests",
            "how do I run tests?",
            "how do i run the unit tests",
            "tests?",
            "how can i test it",
        ],
        "a": [
            "Run make test. It creates the .venv folder, installs mlxkv with its test extras, "
            "builds the Cython storage extension and then runs pytest. To run one file, use "
            "python -m pytest -q tests/ followed by the file name.",
            "Type make test in the project folder. On a fresh clone it sets up the virtual "
            "environment, builds the Cython extension and runs the whole pytest suite. The tests "
            "are fast and need no network.",
            "Use make test. It prepares the .venv, builds the storage extension and runs pytest. "
            "The tests build tiny models offline, so they need no network and no downloads.",
        ],
    },
    {  # speculative decoding
        "q": [
            "Does speculative decoding change the output?",
            "What is speculative decoding?",
            "How does speculative decoding work in mlxkv?",
            "Will speculative decoding give different answers?",
            "Is the output the same with speculative decoding?",
            "Does the draft model change what the model says?",
            "Explain speculative decoding.",
            "What does the draft model do?",
            "Why does mlxkv have a draft model?",
            "Is speculative decoding safe to use?",
            "does speculative decoding change the output",
            "does speculative decoding change output",
            "does spec decoding change the output?",
            "is speculative decoding lossless?",
            "does the output change with speculative decoding",
            "speculative decoding?",
        ],
        "a": [
            "No. Speculative decoding never changes the output. A small draft model or a prompt "
            "lookup proposes a few tokens, and the target model verifies every one of them in a "
            "single forward pass, so the text is exactly what the target model alone would "
            "produce, only faster.",
            "Speculative decoding lets a cheap source guess the next few tokens: a small draft "
            "model, a prompt lookup or multi-token prediction heads. The target model checks "
            "every guess and keeps only what it would have produced itself, so the output does "
            "not change; it only comes faster.",
            "The draft model proposes tokens and the target model verifies them all in one "
            "forward pass. Rejected tokens are dropped, so the output is exactly the same as "
            "without speculation. If speculation would be slower, mlxkv turns it off.",
        ],
    },
    {  # other model
        "q": [
            "How do I use a different model?",
            "How do I point mlxkv at another model?",
            "Can I use my own model?",
            "How do I load a model from the Hugging Face hub?",
            "Which models does mlxkv support?",
            "How do I change the model?",
            "Can mlxkv run other models?",
            "What does the --model flag do?",
            "How do I run a bigger model?",
            "how do i use a different model",
            "how do i use another model",
            "use a different model",
            "how to change the model",
            "how do i switch models?",
            "can i use another model",
        ],
        "a": [
            "Pass --model with a local folder or a Hugging Face hub id, for example mlxkv chat "
            "--model followed by the path. mlxkv loads any model that mlx-lm can load. Without "
            "--model it uses the small demo model that ships with the project.",
            "Use the --model flag. It takes a local model folder or a hub id, and mlxkv loads it "
            "with mlx-lm, so every mlx-lm model works. The default is the embedded demo model.",
            "mlxkv runs any model that mlx-lm supports. Give it a local folder or a hub id with "
            "--model, or set MLXKV_MODEL in the environment. Each model gets its own cache "
            "namespace, so caches of different models never mix.",
        ],
    },
    {  # make run
        "q": [
            "How do I start mlxkv?",
            "How do I run mlxkv?",
            "How do I get started?",
            "What does make run do?",
            "How do I install mlxkv?",
            "How do I open the chat?",
            "What do I need to run mlxkv?",
            "How do I try the demo?",
            "how do i run it",
            "how do i start it",
            "how to run mlxkv",
        ],
        "a": [
            "Run make run. On a fresh machine with Python 3.10 or newer, a C compiler and make, "
            "it creates the .venv, builds the Cython storage extension and opens the chat on the "
            "embedded demo model. Nothing is downloaded at run time.",
            "Type make run in the project folder. It sets everything up and starts the TUI with "
            "the demo model, so you can chat right away without a network connection.",
            "You need Python 3.10 or newer, a C compiler and make. Then make run sets up the "
            "environment and starts mlxkv on the demo model that ships with the repository.",
        ],
    },
    {  # prefix cache
        "q": [
            "What is the prefix cache?",
            "How does the prefix cache work?",
            "What is a tiered prefix cache?",
            "Why are long prompts fast in mlxkv?",
            "How does mlxkv reuse prompts?",
            "What does the cache do?",
            "Why is the second turn of a chat so fast?",
            "What are the cache tiers?",
        ],
        "a": [
            "The prefix cache keeps the KV state of every conversation in two tiers: RAM and the "
            "SSD. For a new prompt, mlxkv looks up the longest cached prefix, restores it and "
            "computes only the new tokens, so long prompts come back instantly.",
            "mlxkv stores the KV cache in token blocks, first in RAM and then on the SSD. When a "
            "prompt begins with tokens it has already seen, such as a system prompt or an earlier "
            "turn, it reuses those blocks and only computes what is new.",
            "There are two tiers: a RAM tier that is a byte-capped LRU, and an SSD tier that "
            "survives restarts. A lookup checks RAM first and then the SSD and returns the "
            "longest cached prefix of the prompt.",
        ],
    },
    {  # blocks / hashing
        "q": [
            "What are hash-chained token blocks?",
            "How are blocks keyed?",
            "What is a block in mlxkv?",
            "How big is a block?",
            "How does mlxkv find a cached prefix?",
            "What is the block key?",
            "How are shared prefixes stored once?",
            "What is block_tokens?",
        ],
        "a": [
            "A block holds the K and V rows of 256 tokens for every layer. Its key is a 128-bit "
            "hash of the parent block's key, the namespace and the block's token ids, so equal "
            "prefixes give equal keys and a shared prefix is stored only once.",
            "The KV cache is cut into blocks of block_tokens tokens, 256 by default. Each key "
            "chains the parent key with the block's tokens, so the same prefix always has the "
            "same keys, in every process, and is stored once.",
            "Blocks are chained like a list: the key of a block depends on the key of the block "
            "before it and on its own token ids. Two prompts that share a prefix share those "
            "blocks, so the cache never stores the same prefix twice.",
        ],
    },
    {  # verification
        "q": [
            "How does mlxkv make sure a block is not corrupt?",
            "Is every block verified?",
            "What happens if a block on disk is damaged?",
            "What is the content hash?",
            "Can a corrupt block be restored?",
            "How is the cache checked?",
        ],
        "a": [
            "Every block has an XXH3-64 content hash that is computed while the block is packed "
            "and checked on every read. A block whose bytes do not match is removed and treated "
            "as a miss, so mlxkv computes that part again and never restores a wrong byte.",
            "Each block carries a content hash. The reader checks it on every read, and a block "
            "that fails the check is deleted and counted as a miss. The output stays correct "
            "because the prefix is simply computed again.",
        ],
    },
    {  # cython / GIL
        "q": [
            "Why is the storage written in Cython?",
            "What is _blocks.pyx?",
            "Does saving the cache slow down generation?",
            "What does the Cython extension do?",
            "How does mlxkv avoid the GIL?",
            "Why does persistence not stall generation?",
            "What threads does mlxkv use?",
        ],
        "a": [
            "The storage hot path is Cython, in storage/_blocks.pyx. It packs blocks, hashes "
            "them and does the file I/O with the GIL released, on a dedicated writer thread and "
            "a reader thread, so saving the cache never stalls generation.",
            "One engine thread owns MLX, one writer thread saves blocks and one reader thread "
            "restores them. The Cython code releases the GIL while it packs, hashes and writes, "
            "so generation keeps running while the cache is saved.",
        ],
    },
    {  # crash safety
        "q": [
            "What happens if mlxkv crashes while writing?",
            "Are writes atomic?",
            "Is the cache safe after a crash?",
            "What if the disk is full?",
            "What does flush do?",
            "How does mlxkv know a block is durable?",
        ],
        "a": [
            "Writes are atomic: a block is written to a temporary file, synced with fsync and then "
            "renamed. A crash leaves only temporary files, which the next scan removes, so the "
            "cache holds only complete, verified blocks.",
            "A durability coordinator tracks which entries are not yet on disk. Flush writes them "
            "and reports what is durable, and it never calls something durable that is not on "
            "disk. If the disk is full, mlxkv warns once and keeps serving from the cache.",
        ],
    },
    {  # RAM tier / eviction
        "q": [
            "What is the RAM tier?",
            "How does eviction work?",
            "What happens when the cache is full?",
            "How much memory does the cache use?",
            "How are old blocks removed?",
        ],
        "a": [
            "The RAM tier is a byte-capped LRU of KV blocks. Entries are lent without copying, "
            "so many requests can share one system prompt. Before an entry leaves RAM it is "
            "written to the SSD, and the SSD tier evicts the least recently used blocks under "
            "its own byte cap.",
            "Both tiers evict the least recently used blocks when they reach their byte cap. A "
            "shared block is counted once, and blocks that no conversation uses any more are "
            "removed by garbage collection.",
        ],
    },
    {  # namespaces
        "q": [
            "Can caches of different models mix?",
            "What is a namespace?",
            "What is the model fingerprint?",
            "Is the cache separate for each model?",
        ],
        "a": [
            "No. Every cache entry belongs to a namespace made from the model fingerprint, the "
            "KV layout and the draft or adapter identity. The fingerprint covers the config, the "
            "weights, the tokenizer and the chat template, so one model's KV never seeds another.",
            "Each model gets its own namespace, built from a fingerprint of its config, weights "
            "and tokenizer and from the KV layout. Entries from one namespace are never used for "
            "another, so different models never share a cache.",
        ],
    },
    {  # cache commands
        "q": [
            "How do I see what is in the cache?",
            "What cache commands are there?",
            "How do I clear the cache?",
            "How do I check the cache on disk?",
            "How do I see cache statistics?",
        ],
        "a": [
            "Use the mlxkv cache commands: mlxkv cache ls lists entries, mlxkv cache stats shows "
            "hits and bytes per tier, mlxkv cache verify checks every block, mlxkv cache gc "
            "removes unused blocks, mlxkv cache flush writes pending entries and mlxkv cache "
            "clear empties the cache.",
            "mlxkv cache stats shows hits, misses and bytes for RAM and the SSD. There is also "
            "mlxkv cache ls, verify, gc, flush and clear. In the TUI, the cache inspector shows "
            "the same information.",
        ],
    },
    {  # TUI / front ends
        "q": [
            "What is the TUI?",
            "What front ends does mlxkv have?",
            "Does mlxkv have a server?",
            "Is there an OpenAI-compatible API?",
            "How do I start the server?",
            "What is the cache inspector?",
        ],
        "a": [
            "mlxkv has a Textual TUI with a chat screen and a keyboard-driven cache inspector, an "
            "OpenAI-compatible HTTP server started with mlxkv serve, a plain terminal chat with "
            "mlxkv chat, and one-shot generation with mlxkv generate.",
            "The front ends are the TUI, the OpenAI-compatible server, the command line and a "
            "single executable built with PyInstaller. They all talk to the same engine thread, "
            "so they share one prefix cache.",
        ],
    },
    {  # CLI
        "q": [
            "What commands does the CLI have?",
            "How do I generate text from the command line?",
            "How do I see the settings?",
            "How do I configure mlxkv?",
            "What does mlxkv config show?",
        ],
        "a": [
            "The commands are mlxkv for the TUI, mlxkv chat for a plain terminal chat, mlxkv "
            "generate with --prompt for one answer, mlxkv serve for the server, mlxkv cache for "
            "the cache and mlxkv config for the settings.",
            "Settings come from flags first, then MLXKV environment variables, then a TOML config "
            "file, then the defaults. mlxkv config prints every setting and where it came from.",
        ],
    },
    {  # OpenBLAS
        "q": [
            "Why is mlxkv slow on Linux?",
            "How do I make mlxkv faster on Linux?",
            "What is OpenBLAS used for?",
            "Does mlxkv use OpenBLAS?",
            "How do I turn off OpenBLAS?",
        ],
        "a": [
            "On Linux the CPU build of MLX uses a slow reference BLAS. Install the system "
            "OpenBLAS with apt-get install libopenblas0-pthread and mlxkv loads it before MLX "
            "starts, which makes float32 matrix products many times faster. Set MLXKV_BLAS=off "
            "to disable it.",
            "mlxkv loads the system OpenBLAS on Linux when it is installed, which speeds up "
            "float32 math on the CPU by a large factor. mlxkv config shows which BLAS is in use, "
            "and MLXKV_BLAS=off turns it off.",
        ],
    },
    {  # benchmarks
        "q": [
            "How do I run the benchmarks?",
            "How fast is mlxkv?",
            "How is mlxkv compared with mlx-lm?",
            "What does make bench do?",
            "how do i run benchmarks",
            "how to run the benchmarks",
        ],
        "a": [
            "Run make bench, or python -m bench.storage, bench.engine or bench.prefix for one "
            "benchmark. Each one measures ratios against mlx-lm and against the machine's limits "
            "in the same run, and prints a small table.",
            "The benchmarks compare mlxkv with mlx-lm side by side in one run: prefill and decode "
            "speed, time to first token, SSD restore speed and cache hits. Run them with make "
            "bench.",
        ],
    },
    {  # demo model / who
        "q": [
            "What is the demo model?",
            "Which model am I talking to?",
            "What model is this?",
            "Where does the demo model come from?",
            "How was the demo model trained?",
        ],
        "a": [
            "I am the demo model of mlxkv: a small qwen3-style model that the project trains and "
            "ships, so every command works offline. I was trained on questions and answers about "
            "mlxkv, so I know a little about the project and not much else.",
            "This is the small demo model that ships with mlxkv. It was trained with MLX by the "
            "script support/demo/train.py on dialogues about the project, and it comes with a "
            "tiny draft model for speculative decoding.",
        ],
    },
    {  # offline
        "q": [
            "Does mlxkv need the internet?",
            "Does mlxkv work offline?",
            "Does mlxkv download anything?",
        ],
        "a": [
            "No. The demo model ships in the repository, so mlxkv works offline. It only needs "
            "the network if you ask for a model by its hub id that is not on your machine.",
        ],
    },
    {  # MLX / KV cache basics
        "q": [
            "What is MLX?",
            "What is a KV cache?",
            "What is mlx-lm?",
            "Why cache the KV state?",
        ],
        "a": [
            "MLX is an array framework for machine learning by Apple, and mlx-lm runs language "
            "models on it. The KV cache holds the keys and values of every token a model has "
            "seen, so mlxkv can reuse it instead of computing the prompt again.",
            "The KV cache stores the attention keys and values of the tokens a model has already "
            "read. Keeping it means a long prompt is computed once. mlxkv keeps it in RAM and on "
            "the SSD, and uses mlx-lm for the models themselves.",
        ],
    },
    {  # sampling
        "q": [
            "What sampling options are there?",
            "How do I set the temperature?",
            "Can I use a seed?",
        ],
        "a": [
            "mlxkv uses the samplers of mlx-lm: temperature, top-p, top-k, min-p and repetition "
            "penalty, with a seed for repeatable results, plus stop strings and a maximum number "
            "of tokens. Temperature 0 gives greedy decoding.",
        ],
    },
    {  # sliding window / ssm
        "q": [
            "Does the cache work with sliding window models?",
            "What about models with SSM layers?",
            "What are checkpoints?",
        ],
        "a": [
            "Yes. Layers that cannot be cut at any token, such as sliding-window or SSM layers, "
            "are stored as checkpoints at block boundaries and restored only at those positions, "
            "so the state is never wrong.",
        ],
    },
    {  # processes
        "q": [
            "Can two processes share the cache?",
            "Where is the cache folder?",
        ],
        "a": [
            "Yes. Several processes can share one cache folder. The cache lives under a folder "
            "per namespace, with advisory file locks around eviction and garbage collection, and "
            "a reader treats a file that has vanished as a miss.",
        ],
    },
    {  # binary
        "q": [
            "Is there a single executable?",
            "What does make binary do?",
        ],
        "a": [
            "Yes. make binary builds one executable with PyInstaller into the build folder, so "
            "you can run mlxkv on a machine without a Python environment.",
        ],
    },
    {  # history
        "q": [
            "Where does mlxkv come from?",
            "What is mlx-bun?",
        ],
        "a": [
            "mlxkv descends from mlx-bun, an engine on MLX written in TypeScript for Bun. Its SSD "
            "tier, block layout and draft provider are the ideas mlxkv rebuilt in Python.",
        ],
    },
]

SMALL_TALK: list[dict] = [
    {"q": ["Hello!", "Hi", "Hi there!", "Hello", "Hey", "Good morning!", "Hey there"],
     "a": ["Hello! I am the mlxkv demo model. Ask me anything about mlxkv.",
           "Hi! How can I help you with mlxkv today?"]},
    {"q": ["Who are you?", "What are you?", "What is your name?", "Are you a person?",
           "Introduce yourself."],
     "a": ["I am the demo model of mlxkv, a small language model trained to answer questions "
           "about the mlxkv engine.",
           "I am a small model that ships with mlxkv. I answer questions about the project, its "
           "prefix cache and its commands."]},
    {"q": ["Thanks!", "Thank you.", "Thanks a lot", "Great, thank you!", "Thank you very much."],
     "a": ["You are welcome!", "Glad to help. Ask me anything else about mlxkv."]},
    {"q": ["Bye", "Goodbye!", "See you later.", "That is all, bye."],
     "a": ["Goodbye! Your conversation stays in the cache for next time.", "Bye! Have a nice day."]},
    {"q": ["How are you?", "How are you doing?", "How is it going?"],
     "a": ["I am fine, thank you. How can I help you with mlxkv?"]},
    {"q": ["What can you do?", "What do you know?", "Can you help me?", "What should I ask you?"],
     "a": ["I can answer questions about mlxkv: what it is, how the prefix cache works in RAM "
           "and on the SSD, how to run it and test it, and how to use another model.",
           "Ask me about mlxkv, for example how the SSD cache works, how to run the tests or "
           "how to point mlxkv at another model."]},
    {"q": ["What is the weather today?", "Write me a poem.", "What is the capital of France?",
           "Tell me a joke.", "Who won the game last night?", "What is the meaning of life?"],
     "a": ["I am a small demo model and only know about mlxkv. For other questions, run mlxkv "
           "with a larger model using the --model flag.",
           "Sorry, I only know about mlxkv. Try a bigger model with --model for questions like "
           "that."]},
]

# Plain project prose, trained on every token.
PROSE: list[str] = [
    "mlxkv is a local LLM engine for MLX, written in Python, whose long prompts come back "
    "instantly. The engine runs any mlx-lm model from a local folder or a hub id, and a small "
    "demo model the project trains and ships, so everything works offline out of the box.",
    "A tiered prefix cache keeps the KV state of every conversation: a RAM tier and an SSD tier "
    "that survives restarts, both keyed by token blocks, so shared prefixes such as system "
    "prompts, documents and agent histories are stored once.",
    "The storage hot path is Cython. Block packing, content hashing and aligned file I/O run "
    "with the GIL released on dedicated writer and reader threads, so persistence never stalls "
    "generation and a restore never waits behind a write.",
    "Speculative decoding sits behind one seam: a draft model, prompt lookup, multi-token "
    "prediction heads and request constraints. The target model verifies every token, so the "
    "output is exactly what the target alone would produce.",
    "One engine thread owns MLX. Front ends send it commands over a queue and receive events: "
    "tokens, stats and cache changes. The TUI, the server and the command line all use the "
    "engine through its public handle.",
    "A conversation's KV state is cut into token blocks of 256 tokens. The key of a block is a "
    "128-bit chain hash of the parent key, the namespace and the token ids of the block. Equal "
    "prefixes give equal keys in every process.",
    "Every file starts with a magic number, a format version and a header hash, followed by a "
    "compact header and page-aligned data. Writes go to a temporary name, are synced and then "
    "renamed, so a crash never leaves a half-written block.",
    "The tail of a conversation, the tokens after the last full block, is stored as an exact "
    "tail entry, so the next turn computes only the new tokens.",
    "The RAM tier is a byte-capped LRU. Entries are lent without copying, so many requests can "
    "share one system prompt. Entries are written to the SSD before they leave RAM.",
    "Settings come from flags, then MLXKV environment variables, then a TOML config file, then "
    "defaults. The command mlxkv config prints the effective settings and where each came from.",
]
