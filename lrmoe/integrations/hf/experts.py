"""The swapped experts module: HF's fused experts interface, computed by the expert-parallel layer, with a state
dict in HF's names."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from lrmoe.integrations.hf.data_parallel import DATA_PARALLEL_REFUSAL, DataParallelError
from lrmoe.integrations.hf.families import hf_to_reference, reference_to_hf
from lrmoe.planner.plan import LayerPlan
from lrmoe.planner.replica_routing import route_forward
from lrmoe.runtime.distributed.replica import flatten_experts, unflatten_experts
from lrmoe.runtime.layer import EPMoELayer, recomputing
from lrmoe.runtime.routing import RouterOutput


class _HeldPlacement:
    """The plan of a forward without gradients: every pair computed on the placement the slots hold (even split
    over replicas), nothing dropped or trimmed, the placement kept."""

    name = "held"

    def __init__(self, placement_NS: torch.Tensor):
        self.placement_NS = placement_NS.clone()

    def plan(self, counts_NE: torch.Tensor, prev_counts_E: torch.Tensor | None = None) -> LayerPlan:
        fwd_NG = route_forward(counts_NE, self.placement_NS, "even")
        return LayerPlan.dropless(self.placement_NS, fwd_NG, counts_NE.shape[1], policy=self.name)


class EPExperts(nn.Module):
    """Drop-in for HF's fused experts module: ``forward(hidden_TD, top_k_index_TK, top_k_weights_TK) -> y_TD``
    (Σ_k weight · expert output, as HF's), computed by an :class:`~lrmoe.runtime.layer.EPMoELayer` given HF's routing.

    The layer's expert slots are this module's one parameter, ``slots_SW`` (this rank's slots, [S, 3·D·F]), so
    every engine sees them in ``model.parameters()``: DDP is told to leave them alone
    (:func:`~lrmoe.integrations.hf.data_parallel.ignore_experts_in_ddp`) and the replica store, not a dense optimizer,
    steps them. The layer itself is a plain attribute, not a submodule (its router copy is unused). The state dict
    speaks HF's names (module doc): the slots are not in it.
    """

    def __init__(self, layer: EPMoELayer):
        super().__init__()
        self.__dict__["layer"] = layer  # not a submodule: its only parameter the model needs is the slots
        self.slots_SW = layer.store.slots_SW  # the replica store's own tensor (it never replaces it)
        self.num_experts, self.hidden_dim, self.intermediate_dim = layer.num_experts, layer.hidden, layer.expert_ffn
        self.register_state_dict_post_hook(_emit_hf_weights)
        self.register_load_state_dict_pre_hook(_take_hf_weights)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, ffn={self.intermediate_dim}, "
                f"policy={getattr(self.layer.policy, 'name', type(self.layer.policy).__name__)}, "
                f"rank={self.layer.rank}/{self.layer.num_ranks}")

    def forward(self, hidden_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if getattr(self, "_is_replica", False):  # nn.Module._replicate_for_data_parallel marks nn.DataParallel's copies
            raise DataParallelError(DATA_PARALLEL_REFUSAL)
        layer = self.layer
        routing = RouterOutput(top_k_index, top_k_weights, None)
        guard = self.__dict__.get("guard")  # the first swapped block's: one check per model forward
        if guard is not None and torch.is_grad_enabled() and not recomputing():
            guard.check()
        if torch.is_grad_enabled():
            return layer(hidden_TD, routing=routing)[0]
        # the resident placement: online replication's replicas of a micro-batch are emptied before it (their
        # gradients kept for the step), so an evaluation between micro-batches runs on the home slots
        store = layer.store
        held = _HeldPlacement(store.resident_NS if store.pushed else store.placement_NS)
        return layer(hidden_TD, policy=held, routing=routing)[0]  # changes no planning state

    # -- HF's weights in and out of the replica store ----------------------------------------------------------
    def gather_hf_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) of every expert in the slots' dtype, from the fp32 master shards of all ranks
        (collective)."""
        store = self.layer.store
        flat_EW = store.full_master().to(store.dtype)
        return reference_to_hf(*unflatten_experts(flat_EW, store.hidden, store.ffn))

    @torch.no_grad()
    def load_hf_weights(self, gate_up_EXD: torch.Tensor, down_EDF: torch.Tensor) -> None:
        """Set every expert's weights from HF's fused tensors (each rank its master shard and its slots; no
        collective). The optimizer moments are left as they are."""
        store = self.layer.store
        expected = ((store.num_experts, 2 * store.ffn, store.hidden), (store.num_experts, store.hidden, store.ffn))
        if (tuple(gate_up_EXD.shape), tuple(down_EDF.shape)) != expected:
            raise ValueError(f"gate_up_proj {tuple(gate_up_EXD.shape)} and down_proj {tuple(down_EDF.shape)} do not "
                             f"match this layer's experts {expected}")
        lo, hi = store.bounds[store.rank]
        slots = {}
        for j, e in enumerate(store.placement_NS[store.rank].tolist()):
            slots.setdefault(e, []).append(j)
        for j in slots.pop(-1, []):
            store.slots_SW[j].zero_()
        for e in range(store.num_experts):  # one expert flattened at a time: no second whole copy of the layer
            flat_W = flatten_experts(*hf_to_reference(gate_up_EXD[e:e + 1], down_EDF[e:e + 1]))[0].to(store.device)
            store.master_EW[e].copy_(flat_W[lo:hi].to(torch.float32))
            for j in slots.get(e, []):
                store.slots_SW[j].copy_(flat_W.to(store.dtype))


def _emit_hf_weights(module: EPExperts, state_dict: dict, prefix: str, local_metadata) -> None:
    state_dict.pop(prefix + "slots_SW", None)  # this rank's slots: the gathered experts stand for them
    held = module.__dict__.get("held_hf_weights")  # gathered beforehand on every rank (hold_gathered_weights)
    if held == ():  # without_experts: the experts are saved elsewhere (per-rank shards)
        return
    gate_up, down = held if held is not None else module.gather_hf_weights()
    state_dict[prefix + "gate_up_proj"] = gate_up
    state_dict[prefix + "down_proj"] = down


def _take_hf_weights(module: EPExperts, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs) -> None:
    keys = [prefix + "gate_up_proj", prefix + "down_proj"]
    absent = [k for k in keys if k not in state_dict]
    if absent:
        missing_keys.extend(absent)
    else:
        module.load_hf_weights(state_dict.pop(keys[0]), state_dict.pop(keys[1]))
    state_dict[prefix + "slots_SW"] = module.slots_SW.detach()  # the slots load_hf_weights wrote: copied onto
    # themselves, so that the parameter is neither missing nor changed


@contextmanager
def hold_gathered_weights(model: nn.Module):
    """Gather every swapped block's experts once (collective: every rank enters) and let ``model.state_dict()``
    use them inside the block without a collective, so that a save that only the main process runs
    (``transformers.Trainer``'s checkpoints, ``trainer.save_model()``) writes HF's full tensors there."""
    swapped = [m for m in model.modules() if isinstance(m, EPExperts)]
    for module in swapped:
        module.__dict__["held_hf_weights"] = module.gather_hf_weights()
    try:
        yield
    finally:
        for module in swapped:
            module.__dict__.pop("held_hf_weights", None)


@contextmanager
def without_experts(model: nn.Module):
    """Let ``model.state_dict()`` leave the swapped experts out inside the block (no collective), so that a save
    that only the main process runs writes the dense part alone, the experts going to per-rank shards
    (:func:`lrmoe.integrations.hf.checkpoint.save_sharded`)."""
    swapped = [m for m in model.modules() if isinstance(m, EPExperts)]
    for module in swapped:
        module.__dict__["held_hf_weights"] = ()
    try:
        yield
    finally:
        for module in swapped:
            module.__dict__.pop("held_hf_weights", None)
