"""`megatron-dapo demo --task calculator`: the demo learns to use a tool. Products the tiny model
cannot compute (``task.py``), a compact call format registered beside hermes (``calls.py``), a lazy
teacher's warm start on whole episodes (``teacher.py``, ``assets.py``), the recipe
(``recipe.py``) and configs/demo_calculator.yaml for the multi-turn DAPO run."""
