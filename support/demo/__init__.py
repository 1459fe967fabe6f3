"""Training the embedded demo model (``python -m support.demo.train``; ``make demo-model``):
its corpus (``corpus.py``, ``facts.py``) and the training loop. The trained model ships in
``engine/demo/``."""
