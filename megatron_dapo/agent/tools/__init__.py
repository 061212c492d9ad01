"""Tools for multi-turn episodes, run in processes that can be killed.

- ``spec.py``: ``ToolSpec`` and ``load_tool_config(path)``, the tool YAML (verl's loads as is);
- ``host.py``: ``ToolHost``, which runs calls in tool workers with a time limit, a memory limit
  and kills, and ``ToolResult``;
- ``worker.py``: the tool process (``python -m megatron_dapo.agent.tools.worker``);
- ``builtin.py``: the ``calculator`` and ``python`` builtins;
- ``verl_shim.py``: verl's tool interface, for verl tool classes where verl is not installed.

Import from the modules: this package's ``__init__`` imports nothing, so that a tool worker starts
without the config loader the host needs.
"""
