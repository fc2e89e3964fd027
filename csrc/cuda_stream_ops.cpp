// See cuda_stream_ops.h. Driver entry points are looked up with dlsym once.
#include "cuda_stream_ops.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

#include "futex.h"

namespace loraplex {
namespace {

using CUresult = int;
using CUstream = void*;
using CUdeviceptr = unsigned long long;
using HostFn = void (*)(void*);

constexpr unsigned kWaitValueGeq = 0x0;  // CU_STREAM_WAIT_VALUE_GEQ

struct Driver {
    void* lib = nullptr;
    CUresult (*launch_host_func)(CUstream, HostFn, void*) = nullptr;
    CUresult (*wait_value64)(CUstream, CUdeviceptr, unsigned long long, unsigned) = nullptr;
    CUresult (*host_get_device_pointer)(CUdeviceptr*, void*, unsigned) = nullptr;
    std::string error;
};

Driver& driver() {
    static Driver d;
    static std::once_flag once;
    std::call_once(once, [] {
        d.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (d.lib == nullptr) {
            d.error = "libcuda.so.1 not found (no NVIDIA driver)";
            return;
        }
        d.launch_host_func = reinterpret_cast<decltype(d.launch_host_func)>(dlsym(d.lib, "cuLaunchHostFunc"));
        d.wait_value64 = reinterpret_cast<decltype(d.wait_value64)>(dlsym(d.lib, "cuStreamWaitValue64_v2"));
        if (d.wait_value64 == nullptr) {
            d.wait_value64 = reinterpret_cast<decltype(d.wait_value64)>(dlsym(d.lib, "cuStreamWaitValue64"));
        }
        d.host_get_device_pointer =
            reinterpret_cast<decltype(d.host_get_device_pointer)>(dlsym(d.lib, "cuMemHostGetDevicePointer_v2"));
        if (!d.launch_host_func || !d.wait_value64 || !d.host_get_device_pointer) {
            d.error = "the CUDA driver lacks cuLaunchHostFunc / cuStreamWaitValue64 / cuMemHostGetDevicePointer";
        }
    });
    return d;
}

Driver& checked() {
    Driver& d = driver();
    if (!d.error.empty()) {
        throw std::runtime_error(d.error);
    }
    return d;
}

void check(CUresult rc, const char* what) {
    if (rc != 0) {
        throw std::runtime_error(std::string(what) + " failed with CUresult " + std::to_string(rc));
    }
}

struct StoreAndWake {
    std::atomic<uint64_t>* word;
    uint64_t value;
};

// Runs on a driver thread when the stream reaches it: no CUDA calls allowed here, none made.
void store_and_wake_host(void* arg) {
    auto* job = static_cast<StoreAndWake*>(arg);
    job->word->store(job->value, std::memory_order_release);
    wake_all(job->word);
    delete job;
}

}  // namespace

std::string cuda_stream_ops_unavailable() { return driver().error; }

void launch_store_and_wake(uintptr_t stream, std::atomic<uint64_t>* word, uint64_t value) {
    Driver& d = checked();
    auto* job = new StoreAndWake{word, value};
    CUresult rc = d.launch_host_func(reinterpret_cast<CUstream>(stream), &store_and_wake_host, job);
    if (rc != 0) {
        delete job;
        check(rc, "cuLaunchHostFunc");
    }
}

uintptr_t device_pointer(uintptr_t host_address) {
    Driver& d = checked();
    CUdeviceptr out = 0;
    check(d.host_get_device_pointer(&out, reinterpret_cast<void*>(host_address), 0), "cuMemHostGetDevicePointer");
    return static_cast<uintptr_t>(out);
}

void stream_wait_at_least(uintptr_t stream, uintptr_t device_address, uint64_t value) {
    Driver& d = checked();
    check(d.wait_value64(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(device_address), value,
                         kWaitValueGeq),
          "cuStreamWaitValue64");
}

}  // namespace loraplex
