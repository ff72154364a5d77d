"""The testbed shell: a real fabric in Linux network namespaces, kernel ECMP, real agents.

* :mod:`ark.testbed.netns`    enter a namespace, set sysctls, start processes inside
* :mod:`ark.testbed.fabric`   spec, names and addresses, build and teardown, link failures
* :mod:`ark.testbed.kernel`   the kernel's own route choice (rtnetlink ``RTM_GETROUTE``)
* :mod:`ark.testbed.capture`  spine counters from AF_PACKET rings
* :mod:`ark.testbed.plan`     the flows of a run and the agents' cluster file
* :mod:`ark.testbed.probing`  every source host probes; maps checked against the kernel
* :mod:`ark.testbed.transfer` KV endpoints: TCP receiver, sender that binds the lease's port
* :mod:`ark.testbed.change`   a link failure mid-run and how long hosts take to follow
* :mod:`ark.testbed.run`      one experiment run and its record
"""
