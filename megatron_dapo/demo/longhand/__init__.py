"""`megatron-dapo demo --task longhand`: a demo whose response length varies with the problem, so
that DAPO's length pieces (overlong filtering, soft overlong punishment, token-level loss) have
something to act on. The task and its two worked-solution styles (``task.py``), the warm start's
teacher and length measurements (``teacher.py``), the assets (``assets.py``), the recipe
(``recipe.py``) and configs/demo_longhand.yaml."""
