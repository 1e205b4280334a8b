"""The operator's commands.

verbs  the admin API: the verb table, its server on a unix socket and its client
ctl    the ``onebitctl`` command line
"""
