"""The planner: from routed counts to a :class:`~lrmoe.planner.plan.LayerPlan` (pure; no ``torch.distributed``).

* :mod:`~lrmoe.planner.plan`: the plan, plain data the layer and the simulator both consume, and
  :class:`~lrmoe.planner.plan.Policy`, the one interface of what makes it (``name``, ``plan(counts_NE,
  prev_counts_E) -> LayerPlan``);
* :mod:`~lrmoe.planner.policies`: the policies (static EP, capacity, SYMI, LRMoE, trimmed), each ``plan`` a placement
  and ``plan_on``, the critical path that needs this micro-batch's counts;
* :mod:`~lrmoe.planner.batched`: the critical paths of every layer of a micro-batch in one call;
* :mod:`~lrmoe.planner.online`: online replication from the current forward;
* :mod:`~lrmoe.planner.placement`: SYMI's and LRMoE's placements, and the memory-aware slot count;
* :mod:`~lrmoe.planner.replica_routing`: which replica computes which pairs, forward and backward;
* :mod:`~lrmoe.planner.quotas`: LRMoE's retention quotas (cap and budget modes, the floor, the memory cap);
* :mod:`~lrmoe.planner.reference`: the critical path's previous implementation, the reference its tests and
  benchmark compare against.

Shape letters (DESIGN.md §8 has the full glossary): N ranks (a second rank index is N again), S slots per rank,
G = N·S global slots (slot g lives on rank g // S), E experts, A hosted slots in (expert, slot) order, V backward
flows (source, from slot, to slot, count), Q quota groups.
"""
