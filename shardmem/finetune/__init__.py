"""Fine-tuning: frozen parameters, low-rank adapters and a quantized base (``finetune:`` in the config).

    finetune: {lora: {rank: 16, alpha: 32, targets: [layers/wq, layers/wk, layers/wv, layers/wo]},
               quantize: {format: nf4, targets: [layers/*]}}

:class:`FineTune` is that section resolved for one model; :func:`~shardmem.program.build_program` keeps the
trainable and frozen parameters apart in the state (``state["params"]``, ``state["frozen"]``), so the
optimizer and its state see only what trains, and the plan counts both exactly.
"""

from shardmem.finetune.lora import Adapted, project, value_of, weight
from shardmem.finetune.quant import FORMATS, Quantized, quantize
from shardmem.finetune.spec import FineTune

__all__ = ["FORMATS", "Adapted", "FineTune", "Quantized", "project", "quantize", "value_of", "weight"]
