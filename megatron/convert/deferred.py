"""A mapping whose values are made when they are read, and not kept.

A conversion's full form (megatron/convert/reshard.py `FullCheckpoint`) holds every tensor
whole. Made at once, that is one more checkpoint in memory; made per name as it is read, a
rank that cuts its own shard out of each full tensor in turn holds its shards and one full
tensor at a time. Reading a name twice makes it twice, so a reader that needs every value
more than once takes `dict(mapping)`.
"""

from collections.abc import Mapping


class Deferred(Mapping):
    """{name: make(name)} for `names`, made at each read; `then` chains a function onto one
    name's value (a vocabulary re-pad of the word embeddings, say)."""

    def __init__(self, names, make):
        self._makers = {name: make for name in names}

    def __getitem__(self, name):
        return self._makers[name](name)

    def __iter__(self):
        return iter(self._makers)

    def __len__(self):
        return len(self._makers)

    def __contains__(self, name):  # Mapping's would make the value
        return name in self._makers

    def then(self, name, function):
        """From now on `self[name]` is function(what it was)."""
        make = self._makers[name]
        self._makers[name] = lambda key: function(make(key))
