"""``meshtrain train``: not built yet."""


def add_parser(sub):
    pass
