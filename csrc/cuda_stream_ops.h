// Stream-ordered signalling between a CUDA stream and host shared memory, with
// no CUDA build dependency: the driver API (libcuda.so.1) is opened at run time.
//
// - launch_store_and_wake: when the stream reaches this point, a driver thread
//   stores `value` into a 64-bit word and futex-wakes its waiters (the CPU
//   workers). The launching thread never blocks.
// - stream_wait_at_least: the stream (not the host) waits until a 64-bit word
//   in host-registered memory is >= `value` (cuStreamWaitValue64, GEQ).
// Without a driver both report unavailable instead of failing at import.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace loraplex {

// Empty string when the driver and the stream memory operations are usable,
// else why not.
std::string cuda_stream_ops_unavailable();

// CUstream handle as an integer (torch.cuda.Stream.cuda_stream); word in host memory.
void launch_store_and_wake(uintptr_t stream, std::atomic<uint64_t>* word, uint64_t value);

// Device-visible address of host-registered memory: `host_address` mapped for the current context.
uintptr_t device_pointer(uintptr_t host_address);

void stream_wait_at_least(uintptr_t stream, uintptr_t device_address, uint64_t value);

}  // namespace loraplex
