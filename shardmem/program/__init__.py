"""Programs: what runs, resolved once from a config and a mesh, then built.

    description = describe(config, mesh)          # every decision and check of the config, once
    program = build_training(description)         # = build_program(config, mesh)
    state = program.init()
    state, metrics = program.step(state, batch)

The flow: :mod:`shardmem.config` -> :func:`~shardmem.program.description.describe` (the
:class:`~shardmem.program.description.Description`: the model and its remat
(:mod:`~shardmem.program.model`), rules, attention, precision, pipeline and context
(:mod:`~shardmem.program.parallelism`), a fine-tune's split, and for training the batch
(:mod:`~shardmem.program.batch`), the loss (:mod:`~shardmem.program.loss`), the optimizer and its state
(:mod:`~shardmem.program.optimizer`)) -> a builder -> a :class:`~shardmem.program.program.Program` of
its kind (training: :mod:`~shardmem.program.step`, with :mod:`~shardmem.program.accumulation`).
Planning (:mod:`shardmem.planning`), the training loop (:mod:`shardmem.run`) and the searches
(:mod:`shardmem.explore`) consume programs, whatever their kind.
"""

from shardmem.program.description import Description, Serving, Training, describe
from shardmem.program.loss import LossFn, next_token_loss
from shardmem.program.model import ModelFactory
from shardmem.program.parallelism import pipeline_for
from shardmem.program.program import Function, Program
from shardmem.program.serving import ServingProgram, build_serving, serving_program
from shardmem.program.step import TrainingProgram, build_program, build_training

__all__ = [
    "Description",
    "Function",
    "LossFn",
    "ModelFactory",
    "Program",
    "Serving",
    "ServingProgram",
    "Training",
    "TrainingProgram",
    "build_program",
    "build_serving",
    "build_training",
    "describe",
    "next_token_loss",
    "pipeline_for",
    "serving_program",
]
