"""Programs: what runs, built from a config and a mesh.

    program = build_program(config, mesh)         # the sharded training step
    state = program.init()
    state, metrics = program.step(state, batch)

The step (:mod:`~shardmem.program.step`), its optimizer and where the optimizer's state lives
(:mod:`~shardmem.program.optimizer`), gradient accumulation (:mod:`~shardmem.program.accumulation`) and
the batch a step consumes (:mod:`~shardmem.program.batch`). Planning (:mod:`shardmem.planning`), the
training loop (:mod:`shardmem.run`) and the searches (:mod:`shardmem.explore`) consume programs.
"""

from shardmem.program.step import (
    LossFn,
    ModelFactory,
    Program,
    build_program,
    next_token_loss,
    pipeline_for,
)

__all__ = ["LossFn", "ModelFactory", "Program", "build_program", "next_token_loss", "pipeline_for"]
