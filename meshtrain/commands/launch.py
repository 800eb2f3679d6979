"""``meshtrain launch``: not built yet."""


def add_parser(sub):
    pass
