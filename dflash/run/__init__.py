"""What keeps a run going and lets it continue: the run folder (`folder`), checkpoints (`checkpoint`)
and what they hold (`state`), the run loop (`loop`: steps, log windows, evaluation and save cadence, the
stop), the stop decision (`stopping`), data-parallel wrapping (`data_parallel`) and CUDA-graph capture
(`graphs`). Below evaluation and the trainer; never imports them (the loop asks its `Trainee` protocol)."""
