"""What ckptd knows about each framework's saves, one module per framework.

A module here owns one framework's save contract: what a finished save holds (its weights in
every form the framework writes them, its markers, its rank census), the order it writes them,
and what a save cut short looks like. `hfweights` holds the weight forms the Hugging Face
libraries share (transformers' save_pretrained, accelerate's save_state, PEFT's adapters), and
`copyin` what a copier that died midway leaves; both are used by the frameworks that write them.
"""
