// Gather/scatter copy kernel of pegaflow-transport-cuda.
//
// One launch copies a list of descriptors {src, dst, len} (device-visible addresses: device
// memory, a staging buffer, or mapped pinned host memory). Thread blocks take descriptors in a
// grid-stride loop; the threads of a block copy one descriptor together, 16 bytes per thread
// per access (4 accesses in flight) when src, dst and len are all 16-byte aligned, byte by byte
// otherwise. The host splits descriptors to at most 64 KiB so blocks share the work evenly.
//
// src/kernels.ptx is generated from this file by `cargo run -p pegaflow-transport-cuda
// --features nvrtc-gen --example gen_ptx` (NVRTC, compute_70, so every driver since CUDA 11.8
// JIT-compiles it for its GPU). Keep the two in sync.

struct CopyDesc {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long len;
};

extern "C" __global__ void __launch_bounds__(256)
pf_copy(const CopyDesc* __restrict__ descs, unsigned int n)
{
    for (unsigned int i = blockIdx.x; i < n; i += gridDim.x) {
        const unsigned long long s = descs[i].src;
        const unsigned long long d = descs[i].dst;
        const unsigned long long len = descs[i].len;
        if (((s | d | len) & 15ull) == 0) {
            const uint4* __restrict__ sp = reinterpret_cast<const uint4*>(s);
            uint4* __restrict__ dp = reinterpret_cast<uint4*>(d);
            const unsigned long long nv = len >> 4;
            const unsigned long long st = blockDim.x;
            unsigned long long j = threadIdx.x;
            for (; j + 3 * st < nv; j += 4 * st) {
                const uint4 a = sp[j];
                const uint4 b = sp[j + st];
                const uint4 c = sp[j + 2 * st];
                const uint4 e = sp[j + 3 * st];
                dp[j] = a;
                dp[j + st] = b;
                dp[j + 2 * st] = c;
                dp[j + 3 * st] = e;
            }
            for (; j < nv; j += st) {
                dp[j] = sp[j];
            }
        } else {
            const unsigned char* sp = reinterpret_cast<const unsigned char*>(s);
            unsigned char* dp = reinterpret_cast<unsigned char*>(d);
            for (unsigned long long j = threadIdx.x; j < len; j += blockDim.x) {
                dp[j] = sp[j];
            }
        }
    }
}
