"""The learner side of a node, with no network: the model (``model``), data (``data``) and task (``task``:
model + data + loss, ``load_task``, ``evaluate``); the learner (``learner``: inner optimiser, fragment
snapshots, bases, the outer gradients it contributes and the merged fragments it adopts); the loop that
trains it in its own thread (``loop``); and multi-process learner units over ``torch.distributed``
(``unit``: DDP, ``unit_fsdp``: FSDP2). Your model and data: transformers causal LMs (``hf``), sharded
text/JSONL/Parquet read in a disjoint recorded order (``corpus``), tokenisers (``tokenize``), presets
(``presets``) and locally generated example inputs (``examples``).

May import: ``protocol``, ``node.common``.
"""
