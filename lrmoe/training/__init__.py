"""The training loop of ``experiments/train.py`` as library code: the script keeps its command line and its checks;
everything a rank does, and the launch of the ranks, lives here.

* :mod:`~lrmoe.training.schedule`: the learning-rate schedule (constant, or warm-up then cosine), a pure function of
  the step, and torch's scheduler along it;
* :mod:`~lrmoe.training.models`: the two architectures behind one interface (lrmoe's own transformer, Hugging Face's
  Qwen3-MoE / GLM-4.5 on the expert-parallel layer) and the function that builds a rank's model;
* :mod:`~lrmoe.training.sizing`: what a run is sized by: the system context (experts, ranks, slots), the memory the
  experts of a rank need at a step's peak, and the modelled time of a step's plans (--cost-model);
* :mod:`~lrmoe.training.records`: one step's results row and the validation loss;
* :mod:`~lrmoe.training.resume`: the arguments that define a run, its checkpoint folder, which run --resume
  continues and where;
* :mod:`~lrmoe.training.loop`: one rank's training loop (batches, steps, records, checkpoints, the recorded trace);
* :mod:`~lrmoe.training.launch`: the world a launch gives and its EP size (checked before any rank starts), and the
  launch: one of torchrun's ranks, the fork launcher's, or the emulated engine's.

Nothing is imported here, and :mod:`~lrmoe.training.schedule` imports torch only to build the scheduler, so a script's
parser can read the schedule names without loading torch.

Shape letters (DESIGN.md §8 has the full glossary): M micro-batches, L layers, N ranks, E experts.
"""
