"""``meshtrain ckpt``: not built yet."""


def add_parser(sub):
    pass
