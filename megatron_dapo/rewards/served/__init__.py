"""Rewards from a served model (``reward.model``): a classifier reward model on SGLang's
``/classify``, or a generative judge; outcomes that say why a sample is unscored instead of
scoring it 0; the checkpoint copy that corrects SGLang's classifier head, and the start-up check
that the served model scores as transformers does.

Modules: ``outcome`` (what goes in and out), ``transport`` (retries, in-flight bound, down
servers), ``classifier``, ``judge`` (and its verdict parsers), ``client`` (one reward model,
async and blocking), ``checkpoint`` (the served copy), ``startup_check``, ``combine``
(``reward.combine``), ``settings`` (the config section, the servers to start).
"""
