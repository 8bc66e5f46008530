"""bertserve's model package: BERT (Devlin et al., 2018) from scratch in PyTorch, its tokenizer, data
pipeline, trainer and checkpoints, and the data-directory contract (model.datadir) that the service
and the workers share. Importable on its own: it never imports app/ or worker/.

Import from the module that defines a name (`from model.modeling import BertModel`,
`from model.tokenizer import BertTokenizer`, `from model.config import BertConfig`): this package
imports nothing itself, so `import model.datadir` (standard library only) does not pull in torch.
"""
