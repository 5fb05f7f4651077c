"""Where the ranks of ``experiments/train.py`` run: the world a launch gives (torchrun's environment, else the fork
launcher's or the emulated engine's --ranks) and its expert-parallel size, checked before any rank starts; and the
launch itself, as one of torchrun's ranks, on the fork launcher's gloo processes, or on the emulated engine's
in-process ranks (the same worker, :func:`lrmoe.training.loop.worker`, each way)."""

from __future__ import annotations


def launch_world(args) -> tuple[int, int, int]:
    """(world size, ranks per node, ranks per EP group) of the launch of ``args``: torchrun's environment when it
    started this process, else --ranks on this machine; --ep-size resolved against them (lrmoe.runtime.distributed.
    mesh). ValueError with the message of the first problem: a malformed torchrun environment, --torchrun without
    torchrun, --engine emulated under torchrun, an EP size the world cannot hold, an EP size below the world with
    --hf-config or --engine emulated."""
    from lrmoe.runtime.distributed.mesh import ep_problem, resolve_ep_size
    from lrmoe.runtime.distributed.torchrun import torchrun_env

    env = torchrun_env()  # ValueError when torchrun's variables are there but malformed
    if args.torchrun and env is None:
        raise ValueError("--torchrun: this process was not started by torchrun (no RANK, LOCAL_WORLD_SIZE, ... in "
                         "its environment); drop --torchrun to fork --ranks ranks here")
    if args.engine == "emulated" and env is not None:
        raise ValueError("--engine emulated runs its ranks as threads of one process: run it with python, not "
                         "torchrun")
    world = args.ranks if env is None else env.world_size
    rpn = world if env is None else env.local_world_size
    ep = resolve_ep_size(args.ep_size, world, rpn)
    if problem := ep_problem(ep, world, rpn):
        raise ValueError(problem)
    for flag, used in (("--hf-config", args.hf_config), ("--engine emulated", args.engine == "emulated")):
        if used and ep != world:  # one EP group: HF's swap and the in-process group know no mesh
            raise ValueError(f"{flag} runs with EP = the world ({world} ranks); --ep-size {ep} is not supported "
                             f"there (pass --ep-size {world})")
    return world, rpn, ep


def run_ranks(args) -> list[dict]:
    """Train the run of ``args`` (parsed and checked) on its ranks: as one of torchrun's, or on the fork launcher's
    --ranks processes, or on the emulated engine's in-process ranks; rank 0's records."""
    from lrmoe.integrations.data import load_corpus
    from lrmoe.runtime.distributed.torchrun import torchrun_env
    from lrmoe.training.loop import worker
    from lrmoe.training.resume import hold_checkpoints

    if torchrun_env() is not None:  # one of torchrun's ranks
        import torch.distributed as dist

        from lrmoe.runtime.distributed.comm import init_process_group_from_env

        info = init_process_group_from_env(timeout_s=args.timeout)  # --timeout bounds each collective's wait
        chosen = [args.run_id, args.start_step]
        dist.broadcast_object_list(chosen, src=0)  # a new run's id and the resumed step: rank 0's
        args.run_id, args.start_step = chosen
        held = hold_checkpoints(args) if info.rank == 0 else None  # rank 0 holds the folder for the run
        try:
            if held is not None and args.overwrite:
                held.remove_own()
            dist.barrier()
            history = worker(info.rank, args)
        finally:
            if held is not None:
                held.release()
        dist.destroy_process_group()
        return history
    held = hold_checkpoints(args)
    try:
        if held is not None and args.overwrite:
            held.remove_own()
        if args.engine == "emulated":  # the same worker on in-process ranks (lrmoe.runtime.inprocess)
            from lrmoe.runtime.inprocess import launch_inprocess

            return launch_inprocess(worker, args.ranks, args, timeout_s=args.timeout)[0]

        from lrmoe.runtime.distributed.launch import launch

        # Read the corpus and import what the ranks' optimizers import, once, here: the forked ranks inherit both (a
        # process reads a corpus once) instead of spending seconds on each.
        load_corpus(args.data, max_bytes=args.max_bytes)
        # no bound on the run's length; --timeout bounds each collective's wait, and past it names the ranks that hang
        return launch(worker, args.ranks, args, timeout_s=None, pg_timeout_s=args.timeout,
                      preload=("torch._dynamo",))[0]
    finally:
        if held is not None:
            held.release()
