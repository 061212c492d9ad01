"""Multi-turn tool-use episodes as tokens (``rollout.multi_turn``).

An episode is the prompt, then model turns and environment turns, all as token ids: each model
turn is sent to the engine as ids (the conversation is never re-rendered from text), its sampled
tokens enter the response with loss mask 1 and their engine log-probs; the environment's answer
(tool results, rendered by the model's chat template as an append-only suffix) enters it with loss
mask 0. The pieces:

- ``runner.py``: the episode loop the rollout manager runs for each engine call (``MultiTurn``;
  a single-turn response is the one-turn case, ``rollout.episodes.SingleTurn``);
- ``tool_instances.py``: the runner the manager is handed, keeping each run of an episode's verl
  tool instances its own (released when aborted, dropped or retried);
- ``bridge.py``: the chat-template bridge between turns;
- ``calls.py``: tool-call parsers by format name (``hermes``, and any registered);
- ``tools/``: tool specs from YAML, the tool processes (timeouts, kills, limits), built-in tools.
"""
