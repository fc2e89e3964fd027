// loraplex._C: native primitives on words in shared memory.
// Owns cross-process atomics used by the CPU-assist protocol (DESIGN §5);
// never allocates shared memory itself and never holds the GIL while it waits.
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>

namespace py = pybind11;

namespace {

// A writable, C-contiguous buffer viewed as 64-bit words; index checked and aligned.
std::atomic<uint64_t>* word_at(py::buffer buf, py::ssize_t index) {
    py::buffer_info info = buf.request(/*writable=*/true);
    // Any C-contiguous buffer is accepted; its total byte size is what counts. A strided
    // view (a[:, 0], mv[::-1]) would map word `index` outside the elements it exposes.
    py::ssize_t expect = info.itemsize;
    for (py::ssize_t d = info.ndim - 1; d >= 0 && info.size > 0; --d) {
        if (info.shape[d] != 1 && info.strides[d] != expect) {
            throw std::invalid_argument("buffer is not C-contiguous");
        }
        expect *= info.shape[d];
    }
    const py::ssize_t nbytes = info.size * info.itemsize;
    // Compare in words: (index + 1) * 8 overflows for huge indices and wraps back into range.
    if (index < 0 || index >= nbytes / static_cast<py::ssize_t>(sizeof(uint64_t))) {
        throw py::index_error("word index out of range for buffer");
    }
    auto addr = reinterpret_cast<uintptr_t>(info.ptr) + index * sizeof(uint64_t);
    if (addr % alignof(std::atomic<uint64_t>) != 0) {
        throw std::invalid_argument("buffer is not 8-byte aligned");
    }
    static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t), "lock-free 64-bit atomics required");
    return reinterpret_cast<std::atomic<uint64_t>*>(addr);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "loraplex native primitives: atomics on 64-bit words in (shared) memory buffers";
    m.def(
        "atomic_fetch_add",
        [](py::buffer buf, py::ssize_t index, uint64_t value) {
            return word_at(buf, index)->fetch_add(value, std::memory_order_acq_rel);
        },
        py::arg("buf"), py::arg("index"), py::arg("value"),
        "Atomically add value to 64-bit word `index` of a writable buffer; return the previous value.");
    m.def(
        "atomic_load",
        [](py::buffer buf, py::ssize_t index) { return word_at(buf, index)->load(std::memory_order_acquire); },
        py::arg("buf"), py::arg("index"), "Atomically read 64-bit word `index` of a writable buffer.");
}
