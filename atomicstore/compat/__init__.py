"""Drop-in replacements for other checkpoint libraries' APIs: ``compat.flax``
(``flax.training.checkpoints``) and ``compat.fjformer`` (fjformer's streaming
checkpointer: ``CheckpointManager``, ``save_state_to_file``, ``load_checkpoint``)."""
