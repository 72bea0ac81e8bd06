"""Fault tests (SIGKILLed training processes, crashes mid-delete): grouped by the package whose
guarantee they prove. This file puts tests/fault on ``sys.path`` for every test below it, so they
import the shared runners (``resume_runs``, ``lm_loop``) and launch the workers beside it."""
