# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, binding=False
"""The compiled twin of ``aiodist.transport.shm_segment.Ring``: the same ring, the same records,
the same answers (``tests/unit/test_native_ring.py`` gives both the same bytes and demands the
same results and the same errors).

Why compiled: every message passes ``try_write`` on one side and ``peek``/``advance`` on the
other, and a polling loop calls ``pending`` on every turn; in Python each is a dozen bytecode-level
steps (struct calls, memoryview indexing), here a few loads and a ``memcpy``. The counters are
read with acquire and published with release ordering: what x86 gives the Python twin for free,
stated to the C compiler, which might otherwise keep a counter in a register or move a store.

The layout (``aiodist.wire.shm``): a record is a 16-byte prefix (record length u32, header length
u32, payload length u64, little-endian), the header, the payload, padded to 16 bytes; a prefix
whose header length is ``WRAP`` skips to the ring's start. The word indices are those of
``shm_segment`` (``W_HEAD``, ``W_TAIL``). ``tests/unit/test_native_ring.py`` checks the constants.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef extern from *:
    """
    #include <stdint.h>
    #define AIODIST_PREFIX_SIZE 16
    #define AIODIST_ALIGN 16
    #define AIODIST_WRAP 0xFFFFFFFFu
    #define AIODIST_W_HEAD 16
    #define AIODIST_W_TAIL 32
    static inline unsigned long long aiodist_load(const unsigned long long *p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void aiodist_store(unsigned long long *p, unsigned long long v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    static inline void aiodist_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #endif
    }
    #define AIODIST_W_SLEEPING 112
    #define AIODIST_W_WAKE 113
    #ifdef __linux__
    #include <linux/futex.h>
    #include <sys/syscall.h>
    #include <unistd.h>
    #include <time.h>
    #define AIODIST_HAVE_FUTEX 1
    /* The low half of a 64-bit header word (little-endian: at its own address). The segment is
       a shared mapping, so the waits and wakes are the process-shared kind (no FUTEX_PRIVATE). */
    static inline uint32_t *aiodist_futex_word(unsigned long long *w) { return (uint32_t *)w; }
    static inline void aiodist_futex_wait(unsigned long long *w, uint32_t seen, double seconds) {
        struct timespec t;
        t.tv_sec = (time_t)seconds;
        t.tv_nsec = (long)((seconds - (double)t.tv_sec) * 1e9);
        syscall(SYS_futex, aiodist_futex_word(w), FUTEX_WAIT, seen, &t, NULL, 0);
    }
    static inline void aiodist_futex_wake(unsigned long long *w) {
        __atomic_add_fetch(aiodist_futex_word(w), 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, aiodist_futex_word(w), FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
    }
    #else
    #define AIODIST_HAVE_FUTEX 0
    static inline uint32_t *aiodist_futex_word(unsigned long long *w) { return (uint32_t *)w; }
    static inline void aiodist_futex_wait(unsigned long long *w, uint32_t seen, double seconds) {}
    static inline void aiodist_futex_wake(unsigned long long *w) {}
    #endif
    static inline void aiodist_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    static inline unsigned long long aiodist_count(unsigned long long *p, long long by) {
        return __atomic_add_fetch(p, (unsigned long long)by, __ATOMIC_SEQ_CST);
    }
    static inline uint32_t aiodist_load32(uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    """
    const int PREFIX_SIZE "AIODIST_PREFIX_SIZE"
    const int ALIGN "AIODIST_ALIGN"
    const uint32_t WRAP "AIODIST_WRAP"
    const int W_HEAD "AIODIST_W_HEAD"
    const int W_TAIL "AIODIST_W_TAIL"
    const int W_SLEEPING "AIODIST_W_SLEEPING"
    const int W_WAKE "AIODIST_W_WAKE"
    const bint HAVE_FUTEX "AIODIST_HAVE_FUTEX"
    uint32_t *aiodist_futex_word(unsigned long long *w) nogil
    void aiodist_futex_wait(unsigned long long *w, uint32_t seen, double seconds) nogil
    void aiodist_futex_wake(unsigned long long *w) nogil
    void aiodist_fence() nogil
    unsigned long long aiodist_count(unsigned long long *p, long long by) nogil
    uint32_t aiodist_load32(uint32_t *p) nogil
    unsigned long long aiodist_load(const unsigned long long *p) nogil
    void aiodist_store(unsigned long long *p, unsigned long long v) nogil
    void aiodist_relax() nogil

# (checked against the Python modules' values by the tests)
LAYOUT = {
    "PREFIX_SIZE": PREFIX_SIZE, "ALIGN": ALIGN, "WRAP": WRAP, "W_HEAD": W_HEAD, "W_TAIL": W_TAIL,
    "W_SLEEPING": W_SLEEPING, "W_WAKE": W_WAKE,
}



cdef class Ring:
    """A single-producer single-consumer ring of records inside a segment (see the Python twin)."""

    # (its fields are declared in _shm_ring.pxd, for the compiled readers that share it)

    def __init__(self, seg):
        self.seg = seg
        self.data = seg.data
        self.words = seg.words
        self.cap = seg.capacity
        self.mask = self.cap - 1
        self._data = self.data  # (holds the mapping while this ring lives)
        self._words = self.words
        self._base = &self._data[0]
        self._w = &self._words[0]
        self.head = aiodist_load(&self._w[W_HEAD])
        self.tail = aiodist_load(&self._w[W_TAIL])

    @property
    def max_record(self):
        """The largest record that always fits in an empty ring."""
        return self.cap // 2

    # -- producer ------------------------------------------------------------------------
    def try_write(self, header, payload):
        """Append one record; False when there is no room now (nothing written)."""
        cdef Py_buffer h
        cdef Py_buffer p
        PyObject_GetBuffer(header, &h, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(payload, &p, PyBUF_SIMPLE)
            try:
                return self._write(<const unsigned char *>h.buf, h.len, <const unsigned char *>p.buf, p.len)
            finally:
                PyBuffer_Release(&p)
        finally:
            PyBuffer_Release(&h)

    cdef bint _write(self, const unsigned char *hdr, Py_ssize_t hlen,
                     const unsigned char *pay, Py_ssize_t plen) except -1:
        cdef Py_ssize_t cap = self.cap
        cdef unsigned long long need = (PREFIX_SIZE + hlen + plen + ALIGN - 1) & ~(<unsigned long long>ALIGN - 1)
        cdef unsigned long long head = self.head
        cdef Py_ssize_t pos = head & self.mask
        cdef long long free = cap - <long long>(head - aiodist_load(&self._w[W_TAIL]))
        cdef unsigned long long pad = cap - pos if pos + need > <unsigned long long>cap else 0
        if <long long>(pad + need) > free:
            return False
        if pad:
            _prefix(self._base + pos, <uint32_t>pad, WRAP, 0)
            head += pad
            pos = 0
        _prefix(self._base + pos, <uint32_t>need, <uint32_t>hlen, <uint64_t>plen)
        cdef unsigned char *start = self._base + pos + PREFIX_SIZE
        if hlen:
            memcpy(start, hdr, hlen)
        if plen:
            memcpy(start + hlen, pay, plen)
        self.head = head + need
        aiodist_store(&self._w[W_HEAD], self.head)  # publish (after the bytes: release order)
        return True

    def consumed(self):
        """Bytes the consumer has freed so far."""
        return aiodist_load(&self._w[W_TAIL])

    # -- consumer ------------------------------------------------------------------------
    def peek(self):
        """The next record (header bytes, payload, record length), or None when empty.

        Raises:
            ValueError: the ring holds nonsense (the producer broke the protocol).
        """
        cdef Py_ssize_t start
        cdef uint32_t rlen, hlen
        cdef uint64_t plen
        if not self._next(&start, &hlen, &plen, &rlen):
            return None
        return self.data[start : start + hlen], self.data[start + hlen : start + hlen + plen], rlen

    cdef bint _next(self, Py_ssize_t *start, uint32_t *hlen_out, uint64_t *plen_out, uint32_t *rlen_out) except -1:
        """Find the next record (skipping WRAPs): where its header starts, the header's, the
        payload's and the record's lengths; False when the ring is empty."""
        cdef unsigned long long tail, head
        cdef long long avail
        cdef Py_ssize_t pos
        cdef uint32_t rlen, hlen
        cdef uint64_t plen
        while True:
            tail = self.tail
            head = aiodist_load(&self._w[W_HEAD])
            if tail == head:
                return False
            avail = <long long>(head - tail)
            if avail > self.cap or tail & (ALIGN - 1):
                raise ValueError(f"ring counters out of range (head {head}, tail {tail})")
            pos = tail & self.mask
            memcpy(&rlen, self._base + pos, 4)
            memcpy(&hlen, self._base + pos + 4, 4)
            memcpy(&plen, self._base + pos + 8, 8)
            if rlen < PREFIX_SIZE or rlen & (ALIGN - 1) or pos + rlen > self.cap or rlen > avail:
                raise ValueError(f"bad record length {rlen} at {pos}")
            if hlen == WRAP:
                self.tail = tail + rlen
                continue
            if plen > rlen or PREFIX_SIZE + <uint64_t>hlen + plen > rlen:
                raise ValueError(f"record at {pos} overflows its length")
            start[0] = pos + PREFIX_SIZE
            hlen_out[0] = hlen
            plen_out[0] = plen
            rlen_out[0] = rlen
            return True

    def advance(self, unsigned long long rlen):
        """Done with the record ``peek`` returned: free it (and any WRAP before it)."""
        self._advance(rlen)

    cdef void _advance(self, unsigned long long rlen) noexcept:
        self.tail += rlen
        aiodist_store(&self._w[W_TAIL], self.tail)

    def pending(self):
        return aiodist_load(&self._w[W_HEAD]) != self.tail

    def wait_pending(self, double seconds):
        """Spin, with the GIL released, until a record is there (or the reader moved) or
        ``seconds`` have passed; whether either happened. (For a thread that waits for its peer without a loop: the
        loop's thread runs meanwhile.)"""
        cdef unsigned long long tail = self.tail
        cdef unsigned long long *head = &self._w[W_HEAD]
        cdef unsigned long long *freed = &self._w[W_TAIL]
        cdef double deadline
        cdef timespec now
        cdef bint seen = False
        with nogil:
            clock_gettime(CLOCK_MONOTONIC, &now)
            deadline = now.tv_sec + now.tv_nsec * 1e-9 + seconds
            while True:
                if aiodist_load(head) != tail or aiodist_load(freed) != tail:
                    seen = True  # (a record, or the loop's thread took one meanwhile)
                    break
                clock_gettime(CLOCK_MONOTONIC, &now)
                if now.tv_sec + now.tv_nsec * 1e-9 >= deadline:
                    break
                aiodist_relax()
        return seen

    @property
    def can_sleep(self):
        """Whether ``sleep_pending`` sleeps until woken (Linux futexes; elsewhere it returns)."""
        return HAVE_FUTEX

    def sleep_pending(self, Ring mine, double seconds):
        """Sleep, with the GIL released, until a record is here (or the reader moved), the
        writer wakes this thread, or ``seconds`` have passed; whether a record or a move was
        seen. ``mine`` is the ring this process writes to the same peer: the sleepers' count
        and the wake word are in its header, where the peer looks after it writes
        (``wake_sleepers``). Spurious returns are possible: the caller looks again."""
        cdef unsigned long long tail = self.tail
        cdef unsigned long long *head = &self._w[W_HEAD]
        cdef unsigned long long *freed = &self._w[W_TAIL]
        cdef unsigned long long *count = &mine._w[W_SLEEPING]
        cdef unsigned long long *word = &mine._w[W_WAKE]
        cdef uint32_t seen
        cdef bint moved
        with nogil:
            seen = aiodist_load32(aiodist_futex_word(word))
            aiodist_count(count, 1)  # (a full barrier: the looks below come after it)
            moved = aiodist_load(head) != tail or aiodist_load(freed) != tail
            if not moved:
                aiodist_futex_wait(word, seen, seconds)
                moved = aiodist_load(head) != tail or aiodist_load(freed) != tail
            aiodist_count(count, -1)
        return moved

    def wake_sleepers(self):
        """Wake the threads that sleep on this ring's header, if any (``sleep_pending``, where
        it is their ``mine``): the peer's after this process wrote them a record, this
        process's own after its loop's thread read one for them. Whether there were any."""
        cdef unsigned long long *count = &self._w[W_SLEEPING]
        aiodist_fence()  # (what was written before, before the look at the count)
        if aiodist_load(count) == 0:
            return False
        aiodist_futex_wake(&self._w[W_WAKE])
        return True


cdef inline void _prefix(unsigned char *at, uint32_t rlen, uint32_t hlen, uint64_t plen) noexcept:
    memcpy(at, &rlen, 4)
    memcpy(at + 4, &hlen, 4)
    memcpy(at + 8, &plen, 8)
