"""Development support shared by the tests, the benchmarks and the demo-model training:
the random-weight model builders (:mod:`support.modelgen`) and the demo model's corpus and
training (:mod:`support.demo`). Not part of the installed package."""
