"""The two Python files a low-rank Hugging Face export carries beside its weights (`auto_map`):
`configuration_boostjax_lowrank.py` and `modeling_boostjax_lowrank.py`. They import torch and
transformers, never boostjax: transformers loads them from the exported folder with
`trust_remote_code=True`. `boostjax.interop.hf_lowrank` copies them."""
