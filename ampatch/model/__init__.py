"""The model side of O2/O3/O5, keep_fp32 and fp8: what happens to the user's `nn.Module`.

- `cast`: the model cast to half and back (`ModelHandle`), its FP32 `state_dict`;
- `sharded`: the same for FSDP2-sharded models (`ShardedModel`), beside it (which of the two a
  model gets: `cast.is_sharded`);
- `forwards`: the wrapped forward of a cast model (inputs to half, outputs to FP32) and of
  the modules kept in FP32; `default_dtype`: torch's default dtype while a cast model runs;
- `keep`: which modules `keep_fp32` names (the kept-FP32 modules);
- other libraries' model conventions (Hugging Face's: `frameworks.hf_conventions`) register
  with `cast.add_convention`;
- `fp8_choice`: which Linear layers `fp8=` runs in FP8, each with its reason; `fp8`: torchao's
  float8 training on them, converted in place and put back.
"""
