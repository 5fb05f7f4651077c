"""The experiment scripts, importable as lrmoe.experiments.<name> (run them as python experiments/<name>.py)."""
