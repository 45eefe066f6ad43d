"""What the framework plugins (`ampatch.lightning`, `ampatch.huggingface`) share, and nothing
else uses: the level a plugin initializes at (`level`) and the LR scheduler held on a skipped
step (`scheduler_guard`). No framework is imported here.
"""
