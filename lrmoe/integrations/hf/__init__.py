"""Hugging Face transformers drop-in: the sparse MoE blocks of a Qwen3-MoE or GLM-4.5 (``glm4_moe``) model on the
expert-parallel layer, running any system of the registry (:mod:`lrmoe.systems`), on gloo or NCCL.

What is swapped is the block's fused experts module only (``block.experts``, HF's ``forward(hidden_TD,
top_k_index, top_k_weights)``); the block's own forward, its router (``block.gate``), the shared experts and the
rest of the model stay HF's. So HF's router decides (its parameter names, its precision, fp32 for GLM;
``norm_topk_prob`` either way, ``routed_scaling_factor``, the ``e_score_correction_bias`` buffer, group-limited
routing with ``n_group`` / ``topk_group``), its hooks still collect ``output_router_logits``, and its top-k
indices and weights reach the layer as ``routing=`` (:class:`~lrmoe.runtime.routing.RouterOutput`): the layer plans,
dispatches and computes the experts, and the router gradient flows back through HF's weights.

    dist.init_process_group(...)                     # every rank, then the same model on every rank
    ep = swap_moe_blocks(model, "lrmoe")             # each rank keeps its slots and optimizer shard of the experts
    opt = ep.optimizer(torch.optim.AdamW, lr=1e-3,   # a torch Optimizer: HF's dense parameters and the experts,
                       max_grad_norm=1.0)            # clipped to one global gradient norm over both
    for ids in micro_batches:                        # gradient accumulation: k micro-batches, one step
        model(ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad()                      # dense all-reduce, clipping, AdamW, expert Adam +
                                                     # redistribution, GLM bias
    model.save_pretrained(path, is_main_process=rank == 0)   # every rank: the experts are gathered
    # or per-rank shards, nothing gathered, joined later on one process (lrmoe.integrations.hf.checkpoint):
    save_sharded(model, shards)  # then: python -m lrmoe.integrations.hf.checkpoint SHARDS HF_FOLDER

**One gradient convention.** Every method here that reduces gradients (:meth:`HFExpertParallel.sync_dense_grads`,
:meth:`~HFExpertParallel.expert_step`, :meth:`~HFExpertParallel.gather_expert_grads`, :meth:`~HFExpertParallel.step`
and the optimizer object's ``step``) defaults to the gradient of the *mean* loss over the ranks and the step's
micro-batches: the summed gradients times 1 / (ranks x micro-batches), the micro-batches being the training
forwards since the last step. A loop that already divides each micro-batch's loss by their number (HF's Trainer,
Accelerate) passes ``grad_scale=1 / ranks``; ``grad_scale=1.0`` gives the plain sum. Under DDP, whose average
stands for the dense sum over the ranks, the same ``grad_scale`` gives the same gradients.

**Gradient clipping** cannot be ``torch.nn.utils.clip_grad_norm_(model.parameters())``: each rank holds only its
own expert slots, and before the step each replica holds a partial sum of its expert's gradient. ``max_grad_norm``
of :meth:`HFExpertParallel.optimizer` (or of :meth:`~HFExpertParallel.step`; :meth:`~HFExpertParallel.clip_grad_norm_`
in the low-level API) clips that gradient, after the dense all-reduce and the experts' replica-gradient sum, to one
global L2 norm over the dense parameters (once) and the experts (each once), exactly as ``clip_grad_norm_`` over
every parameter of the unswapped model on one process would (:mod:`lrmoe.runtime.clip`). The systems with a
retention budget (ρ < 1) clip the recalibrated gradient their experts' Adam applies.

**A foreign optimizer** (``torch.optim.AdamW(model.parameters())``, ``transformers.Trainer`` without
``optimizers=``) would step the dense parameters and never the experts' sharded Adam: the model's next training
forward after such a step raises :class:`ForeignOptimizerError` (:data:`FOREIGN_OPTIMIZER` names the fix; how it is
detected: :class:`_ForeignStepGuard`).

**Data parallelism.** The experts are parameters of the swapped model (each block's ``experts.slots_SW``: this
rank's slots), named to DistributedDataParallel as parameters to leave alone (its
``_ddp_params_and_buffers_to_ignore``, on the model and every module above a block): DDP carries the dense
gradients, averaged in its backward (overlapped with it, ``no_sync`` for accumulation), and the replica store the
experts'; the step then all-reduces only the non-finite flags (:attr:`HFExpertParallel.dense_reduced_by_ddp`,
:func:`ddp_reducing`). A DDP around a module above the model would reduce the slots: its first training forward
raises :class:`DataParallelError`. ``transformers.Trainer`` (any number of processes) takes ``optimizers=(
ep.optimizer(...), scheduler)`` and ``callbacks=[EPTrainerCallback(ep)]`` (:mod:`lrmoe.integrations.hf.trainer`:
gradient scale, one clipping, checkpoints and resume). ``nn.DataParallel``'s
copies and FSDP are refused (:class:`DataParallelError`).

Weights. HF fuses the experts as ``gate_up_proj`` [E, 2F, D] (gate rows first: ``linear(x, W).chunk(2)``) and
``down_proj`` [E, D, F]; the layer keeps the reference layout ``w_gate_EDF``, ``w_up_EDF``, ``w_down_EFD``
(:func:`hf_to_reference`, :func:`reference_to_hf`). The swapped module's one parameter is the replica store's slots;
the store also holds the fp32 master shards (DESIGN.md §3.5), stepped by :meth:`HFExpertParallel.step`, never by
the dense optimizer. Its ``state_dict`` emits HF's two fused tensors, gathered from every rank's shard (not the
slots), so ``model.state_dict()`` and ``save_pretrained`` of a swapped model are **collective** (call them on every
rank, as with FSDP's full state dict) and give what the unmodified HF class loads; ``load_state_dict`` takes HF's
tensors back (no collective). The training state of the experts (moments, placement, planning state) is per rank:
:meth:`HFExpertParallel.expert_state_dict`.

Planning state. A forward with gradients is a training forward: it plans with the system's policy and advances
the layer's state (previous counts, the plan whose next placement :meth:`~HFExpertParallel.expert_step` moves to).
A forward without gradients (evaluation, generation) computes every pair on the placement the slots hold and
leaves that state as it was (between micro-batches under online replication: on the home slots). Every rank must run
the same number of forwards (they are collective): generate with ``synced_gpus=True``. Several training forwards
before a step are micro-batches of one iteration (their gradients accumulate; the placement holds until the step,
:mod:`lrmoe.runtime.layer`). Activation checkpointing (``model.activation_checkpointing_enable()``, or the
``gradient_checkpointing_enable()`` it replaces in transformers 5; non-reentrant as HF's default) works: the
recomputed forward replays the plan its original forward made.
"""

from lrmoe.integrations.hf.data_parallel import (DATA_PARALLEL_REFUSAL, DDP_REDUCES_EXPERTS, FSDP_REFUSAL,
                                                 DataParallelError, ddp_reducing, fsdp_wrapped,
                                                 ignore_experts_in_ddp, path_to_blocks)
from lrmoe.integrations.hf.expert_parallel import EPOptimizer, HFExpertParallel
from lrmoe.integrations.hf.experts import EPExperts
from lrmoe.integrations.hf.families import (DEFAULT_BIAS_RATE, FAMILIES, Family, hf_config, hf_to_reference,
                                            moe_blocks, reference_to_hf)
from lrmoe.integrations.hf.foreign_optimizer import (FOREIGN_OPTIMIZER, GRAD_SAMPLE, GRADIENT_EDIT,
                                                     ForeignOptimizerError, GradientEditError)
from lrmoe.integrations.hf.swap import gather_trace, load_safetensors_, swap_moe_blocks

__all__ = ["DATA_PARALLEL_REFUSAL", "DDP_REDUCES_EXPERTS", "DEFAULT_BIAS_RATE", "FAMILIES", "FOREIGN_OPTIMIZER",
           "FSDP_REFUSAL", "GRADIENT_EDIT", "GRAD_SAMPLE", "DataParallelError", "EPExperts", "EPOptimizer", "Family",
           "ForeignOptimizerError", "GradientEditError", "HFExpertParallel", "ddp_reducing", "fsdp_wrapped",
           "gather_trace", "hf_config", "hf_to_reference", "ignore_experts_in_ddp", "load_safetensors_", "moe_blocks",
           "path_to_blocks",
           "reference_to_hf", "swap_moe_blocks"]
