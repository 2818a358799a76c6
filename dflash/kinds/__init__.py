"""The draft kinds: DFlash and the kinds that extend it, each declared once as a `record.DraftKind` in
`registry.py`, which everything outside this folder asks (`kind_named`, `kind_of`) instead of naming a kind.

    record.py                          the record: what a kind is made of, supports and adds to a run
    registry.py                        the four records (`KINDS`) and how to find one; what a new kind touches
    domino.py                          Domino: a GRU + embedding correction head (`draft.kind: domino`)
    dflash2.py, dflash2_objective.py   DFlash 2: block convolutions and a candidate selector
    dspark.py, dspark_objective.py     DSpark: a Markov head and a confidence head; slot k predicts a + k + 1

DFlash itself (`modeling.py`, `objective.py`, `losses.py`) sits below: every kind extends it.
"""
