"""Pieces every Triton kernel of verl_moe shares: the launch layer (`launch.py`: capped 1-D grids,
autotune with a pick cache, first config under the interpreter and in deterministic mode, tl.dot
operand type and precision; importing it imports Triton) and the process-wide op state (`runtime.py`)."""
