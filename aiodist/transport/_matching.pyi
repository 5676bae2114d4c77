# The compiled twin of aiodist.transport.matching.Mailbox (_matching.pyx): the same interface,
# so it is typed as the Python twin (the transports see either through Matcher and Receive).
from aiodist.transport.matching import Mailbox as Mailbox
from aiodist.transport.matching import PendingRecv as PendingRecv
