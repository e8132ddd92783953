#include "cpu/dispatch.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace effmem::cpu {
namespace {

bool cpu_has(const std::string& isa) {
  if (isa == "scalar") return true;
#if defined(EFFMEM_X86)
  __builtin_cpu_init();
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  if (isa == "avx512") {
    // BW/VL/DQ too: the unit is built with them, so that the compiler's byte and word loops (8-bit codes)
    // use 512-bit vectors: on a Zen 4 core adam8's step took 0.89x the time, 8-bit and 4-bit dequantize
    // 0.80x and 0.85x (quantize the same). Every AVX-512 x86 CPU since Skylake-SP has them.
    return cpu_has("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
#endif
  return false;
}

bool known(const std::string& isa) { return isa == "avx512" || isa == "avx2" || isa == "scalar"; }

// Only for an isa this CPU has (cpu_has): a table's accessor is compiled with that isa's flags and may run its
// instructions itself (EFFMEM_CPU_ISA=avx512 on an AVX2 CPU died of SIGILL here, before any check).
const KernelTable* table_for(const std::string& isa) {
  if (isa == "avx512") return &kernels_avx512();
  if (isa == "avx2") return &kernels_avx2();
  if (isa == "scalar") return &kernels_scalar();
  return nullptr;
}

// Widest first; EFFMEM_CPU_ISA names the widest one allowed.
const KernelTable* choose_default() {
  const char* env = std::getenv("EFFMEM_CPU_ISA");
  bool allowed = env == nullptr || !known(env);
  for (const char* isa : {"avx512", "avx2", "scalar"}) {
    allowed = allowed || std::string(env) == isa;
    if (allowed && cpu_has(isa)) return table_for(isa);
  }
  return &kernels_scalar();
}

std::atomic<const KernelTable*> g_table{nullptr};

}  // namespace

const KernelTable& kernels() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (!t) {
    t = choose_default();
    g_table.store(t, std::memory_order_release);
  }
  return *t;
}

std::string supported_isas() {
  std::string out;
  for (const char* isa : {"scalar", "avx2", "avx512"}) {
    if (!cpu_has(isa)) continue;
    if (!out.empty()) out += ",";
    out += isa;
  }
  return out;
}

void set_isa(const std::string& name) {
  TORCH_CHECK_VALUE(known(name), "isa must be one of 'scalar', 'avx2', 'avx512', got '", name, "'");
  TORCH_CHECK_VALUE(cpu_has(name), "isa '", name, "' is not supported by this CPU (supported: ",
                    supported_isas(), ")");
  g_table.store(table_for(name), std::memory_order_release);
}

}  // namespace effmem::cpu
