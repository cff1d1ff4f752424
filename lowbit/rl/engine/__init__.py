"""The rollout engine: an inference implementation of lowbit's decoder with its own weights.

    engine = RolloutEngine(model_config, precision="nvfp4", rac_ratio=0.25, device="cuda")
    engine.load_state_dict(policy.state_dict())        # copies, then quantizes on arrival
    rollout = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64,
                                                      stop_token_ids=(10,), seed=0))
    rollout.completions, rollout.logprobs, rollout.routed_experts

It is to the trainer what vLLM is to verl: a separate object that holds its own copy of the
weights (by Hugging Face parameter names: lowbit's models, Llama, Qwen2, Qwen3, Qwen3-MoE),
never the trainer's modules or tensors, so it may sit on another device. It is built as the
small inference engines are (nano-vllm, vLLM), a file per part:

| part     | file          | what it holds                                                          |
| -------- | ------------- | ---------------------------------------------------------------------- |
| config   | `config.py`   | EngineConfig: mode, RAC ratio and channel group, activation scale,     |
|          |               | device, dtype, cache size, CUDA graphs, kernels                        |
| KV cache | `kv_cache.py` | keys and values per layer, indexed by position: each row its length    |
| weights  | `weights.py`  | each linear stored as the mode says (packed NVFP4, FP8, bf16), experts |
|          |               | stacked, weight sync (quantized on arrival, or packed by the sender)   |
| decoder  | `decoder.py`  | prefill and the decode step, on lowbit.dispatch.inference's kernels    |
| runner   | `runner.py`   | RolloutEngine: generate, score, CUDA graphs per batch-size bucket      |

Weights are stored as the precision mode says (lowbit.rl.precision: bf16, fp8, nvfp4-w4a16,
nvfp4, nvfp4 + RAC) and the GEMMs read them as stored -- FP8 as E4M3 codes, NVFP4 packed
(0.5625 bytes a parameter, re-laid as tiles at sync) with `packed_gemm=True`, else a
dequantized copy kept beside the packed weight; attention, norms, the router, the
embeddings, the output head and the KV cache stay in the compute dtype (bf16 on CUDA,
float32 on the CPU).

Batching. Prompts are right-padded for their one prefill forward (causal attention: a row's
real tokens see only real tokens); a prompt given several times (GRPO's num_generations) is
prefilled once, into the first row that samples it, and the rows that repeat it read its
keys and values from there in decode (the same memory for every completion of a prompt, not
a copy each). Each row's cache holds its own tokens at their positions, so a decode step
attends over each row's own length and reads nothing else. On CUDA the decode
step (the forward from token ids to logits, positions advanced) replays from a CUDA graph
captured per batch-size bucket (1, 2, 4, 8, then multiples of 16); sampling runs eagerly
between replays. MoE routing groups tokens by expert on the device, so MoE decode is
graph-captured too.

Per token it returns the log-probability of what it sampled (lowbit.rl.sampling) and, for MoE
models, the experts each token was routed to in each layer (for routing replay, verl's R3).
"""

from lowbit.rl.engine.config import COMPILE_MODES, EngineConfig
from lowbit.rl.engine.runner import Rollout, RolloutEngine, batch_bucket

__all__ = ["RolloutEngine", "Rollout", "EngineConfig", "COMPILE_MODES", "batch_bucket"]
