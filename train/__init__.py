"""Fine-tuning of ``models.llama`` on variable-length instruction data.

Run it as ``python -m train.finetune`` (see ``train.config`` for the flags).
"""
