"""What the core must know of other libraries, kept out of it, and what the framework plugins
share. The core names no other library; these modules register with its hooks on `import
ampatch` (none imports the library it knows of):
- `apex`: Apex's names (`amp._amp_state`, `amp.init`, `optimizer._amp_stash`, ...), lent by
  `ampatch.compat`, which is loaded on first use (`session.addons`);
- `hf_conventions`: Transformers models cast to half (`model.cast.add_convention`) and what
  Accelerate's `prepare` made (`session.addons.add_check`);
- `scheduler_guard`: LR schedulers, a wrapped `optimizer.step` (`base.patcher.tolerate`) and
  one held on a skipped step (for the plugins);
- `level`: the level a plugin (`ampatch.lightning`, `ampatch.huggingface`) initializes at.
"""
