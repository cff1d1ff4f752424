"""RL with NVFP4 rollouts (QUADS): rollout engine, GRPO trainer, weight sync, RAC, TIS.

Not built yet; see DESIGN.md section 4.
"""
