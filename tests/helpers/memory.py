"""A child program's own peak memory, for tests that bound what a command costs.

``ru_maxrss`` survives ``exec``: a program started by ``subprocess`` from a large pytest process would report
that process's size. ``VmHWM`` belongs to the program's own address space, which ``exec`` replaced.
"""

# An expression, for the code of a ``python -c`` child: its peak resident memory so far, in KiB.
PEAK_KIB = "[int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM')][0]"
