"""The draft kinds beyond DFlash, one module pair each: the draft model (a `modeling.DFlashDraftModel` with
its extra heads), its block objective (a `objective.DFlashObjective` with its loss and metrics layout) and
its decoder's proposal walk. `drafts.draft_model_for_config` picks the model class from a config.

    domino.py                          Domino: a GRU + embedding correction head (`draft.kind: domino`)
    dflash2.py, dflash2_objective.py   DFlash 2: block convolutions and a candidate selector
    dspark.py, dspark_objective.py     DSpark: a Markov head and a confidence head; slot k predicts a + k + 1

DFlash itself (`modeling.py`, `objective.py`, `losses.py`) sits below: every kind extends it.
"""
