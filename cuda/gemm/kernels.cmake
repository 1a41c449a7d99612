# The CUTLASS launchers of the batch-invariant GEMM, generated from one list (included by
# CMakeLists.txt when CUDA is built). For each entry CMake writes one translation unit holding the
# launchers of all its tiles (the entries compile in parallel) from gemm_kernel.cu.in, and one
# header, generated/gemm_launchers.h, declares every launcher and, per entry, its kernel set (the
# tiles, largest first) for the dispatcher (matmul_cuda.cu).
#
# Entry: "name family dtype layout C D tile..."
#   family  sm90: CUTLASS 3.x TMA warp-specialized kernel (gemm_sm90.cuh), sm_90a only; built only
#           when the architectures include 90a, else each launcher is a stub that returns an error
#           (the dispatcher picks them on an sm_90 GPU alone, which such a build does not serve);
#           sm80: CUTLASS 2.x kernel (gemm_sm80.cuh): tensor-op mma.sync for bf16/f16, SIMT FFMA for
#           f32; sm_80 machine code plus sm_80 PTX (newer GPUs) when the architectures include 80,
#           sm_90 machine code when they include 90a (Hopper runs these sets for a transposed A,
#           float32 and JAXDET_TESTING=gemm=sm80).
#   dtype   A and B: bf16, f16 or f32.
#   layout  A then B: n = row-major as stored ([M,K] / [K,N]); t = read transposed in place
#           (column-major: A stored [K,M], B stored [N,K]). D is always row-major [M,N].
#   C, D    the epilogue's D = A.B (+ beta C): C void = no source read (sm90 only; the sm80
#           kernels take C of D's type and read it only when beta != 0).
#   tile    the CTA's output tile, ROWSxCOLS (ROWSxCOLS:narrow: the launcher of gemm_narrow.cuh
#           instead of the family's); several tiles make an M-bucketed kernel set (largest
#           area first). Every tile of a set has the same K tile, MMA instruction, mainloop and
#           epilogue (gemm_sm90.cuh / gemm_sm80.cuh), so every tile computes every element with the
#           same operations: the dispatcher may pick any of them from the shape (choose_tile in
#           matmul_cuda.cu; proven bitwise by tests/test_gemm_buckets.py, docs/matmul_cuda.md).
#           sm90: 128xN runs the cooperative schedule (two consumer warpgroups of 64 rows), 64xN
#           the ping-pong schedule, 16x64 the ping-pong schedule on swapped operands (D^T = B^T A^T,
#           gemm_sm90.cuh), 16x32:narrow and 16x16:narrow a mma.sync kernel on swapped operands
#           with the same K steps (gemm_narrow.cuh); sm80: the threadblock tile.
# The forward (nn) and dA (nt) sets end with 16x32 and 16x16 tiles (a 2048-wide output at M <= 16:
# 128 CTAs rather than 64). The sets of a half output (the common case) add 128x128, which serves
# 129-256 rows of a narrow output; the float32 output sets go without it, to keep the build's size.
set(JAXDET_GEMM_SM90_TILES "128x256 64x256 64x128 64x64 16x64 16x32:narrow 16x16:narrow")
set(JAXDET_GEMM_SM90_HALF_TILES "128x256 128x128 64x256 64x128 64x64 16x64 16x32:narrow 16x16:narrow")
set(JAXDET_GEMM_SM80_TILES "128x128 64x64 64x32")
set(JAXDET_GEMM_KERNELS
  # Hopper forward (nn) and dA (nt), half or float32 output: M-bucketed.
  "sm90_bf16_nn_bf16         sm90 bf16 nn void bf16 ${JAXDET_GEMM_SM90_HALF_TILES}"
  "sm90_bf16_nn_f32          sm90 bf16 nn void f32  ${JAXDET_GEMM_SM90_TILES}"
  "sm90_bf16_nt_bf16         sm90 bf16 nt void bf16 ${JAXDET_GEMM_SM90_HALF_TILES}"
  "sm90_bf16_nt_f32          sm90 bf16 nt void f32  ${JAXDET_GEMM_SM90_TILES}"
  "sm90_f16_nn_f16           sm90 f16  nn void f16  ${JAXDET_GEMM_SM90_HALF_TILES}"
  "sm90_f16_nn_f32           sm90 f16  nn void f32  ${JAXDET_GEMM_SM90_TILES}"
  "sm90_f16_nt_f16           sm90 f16  nt void f16  ${JAXDET_GEMM_SM90_HALF_TILES}"
  "sm90_f16_nt_f32           sm90 f16  nt void f32  ${JAXDET_GEMM_SM90_TILES}"
  # Hopper weight gradient (tn): one mainloop, three epilogues: D = C + A^T B in float32 (every
  # chunk but the last), D = A^T B cast to the half dtype (a single chunk), and D = C + A^T B with
  # a float32 C cast to the half dtype (the last chunk). The casts round to nearest even. One tile:
  # its GEMM's rows are the weight's K, never few.
  "sm90_bf16_tn_f32acc       sm90 bf16 tn f32  f32  128x256"
  "sm90_bf16_tn_bf16         sm90 bf16 tn void bf16 128x256"
  "sm90_bf16_tn_f32acc_bf16  sm90 bf16 tn f32  bf16 128x256"
  "sm90_f16_tn_f32acc        sm90 f16  tn f32  f32  128x256"
  "sm90_f16_tn_f16           sm90 f16  tn void f16  128x256"
  "sm90_f16_tn_f32acc_f16    sm90 f16  tn f32  f16  128x256"
  # sm_80 and later: all four layouts, half or float32 output (the *_f32 ones also serve as the
  # weight gradient with beta = 1 off Hopper); the forward and dA layouts are M-bucketed.
  "sm80_bf16_nn_bf16         sm80 bf16 nn bf16 bf16 ${JAXDET_GEMM_SM80_TILES}"
  "sm80_bf16_nn_f32          sm80 bf16 nn f32  f32  ${JAXDET_GEMM_SM80_TILES}"
  "sm80_bf16_nt_bf16         sm80 bf16 nt bf16 bf16 ${JAXDET_GEMM_SM80_TILES}"
  "sm80_bf16_nt_f32          sm80 bf16 nt f32  f32  ${JAXDET_GEMM_SM80_TILES}"
  "sm80_bf16_tn_bf16         sm80 bf16 tn bf16 bf16 128x128"
  "sm80_bf16_tn_f32          sm80 bf16 tn f32  f32  128x128"
  "sm80_bf16_tt_bf16         sm80 bf16 tt bf16 bf16 128x128"
  "sm80_bf16_tt_f32          sm80 bf16 tt f32  f32  128x128"
  "sm80_f16_nn_f16           sm80 f16  nn f16  f16  ${JAXDET_GEMM_SM80_TILES}"
  "sm80_f16_nn_f32           sm80 f16  nn f32  f32  ${JAXDET_GEMM_SM80_TILES}"
  "sm80_f16_nt_f16           sm80 f16  nt f16  f16  ${JAXDET_GEMM_SM80_TILES}"
  "sm80_f16_nt_f32           sm80 f16  nt f32  f32  ${JAXDET_GEMM_SM80_TILES}"
  "sm80_f16_tn_f16           sm80 f16  tn f16  f16  128x128"
  "sm80_f16_tn_f32           sm80 f16  tn f32  f32  128x128"
  "sm80_f16_tt_f16           sm80 f16  tt f16  f16  128x128"
  "sm80_f16_tt_f32           sm80 f16  tt f32  f32  128x128"
  # True float32 on every architecture (SIMT FFMA, never TF32), all four layouts; the tile is the
  # SIMT kernel's own (128x128x8).
  "simt_f32_nn               sm80 f32  nn f32  f32  128x128"
  "simt_f32_nt               sm80 f32  nt f32  f32  128x128"
  "simt_f32_tn               sm80 f32  tn f32  f32  128x128"
  "simt_f32_tt               sm80 f32  tt f32  f32  128x128"
)

set(_jaxdet_type_bf16 "cutlass::bfloat16_t")
set(_jaxdet_type_f16 "cutlass::half_t")
set(_jaxdet_type_f32 "float")
set(_jaxdet_type_void "void")
set(_jaxdet_layout_n "cutlass::layout::RowMajor")
set(_jaxdet_layout_t "cutlass::layout::ColumnMajor")

# Writes the units and the header under ${CMAKE_CURRENT_BINARY_DIR}/generated (the build folder
# goes on the include path: #include "generated/gemm_launchers.h"); sets JAXDET_GEMM_SM90_SOURCES
# and JAXDET_GEMM_SM80_SOURCES. with_sm90: build the sm90 family's kernels (else stubs, in
# JAXDET_GEMM_STUB_SOURCES, which need no CUTLASS and no architecture).
function(jaxdet_generate_gemm_kernels with_sm90)
  set(dir "${CMAKE_CURRENT_BINARY_DIR}/generated")
  set(template "${CMAKE_CURRENT_SOURCE_DIR}/cuda/gemm/gemm_kernel.cu.in")
  set(sm90_sources "")
  set(sm80_sources "")
  set(stub_launchers "")
  set(declarations "")
  set(sets "")
  set(names "")
  foreach(entry IN LISTS JAXDET_GEMM_KERNELS)
    string(STRIP "${entry}" entry)
    string(REGEX REPLACE " +" ";" fields "${entry}")
    list(LENGTH fields n)
    if(n LESS 7)
      message(FATAL_ERROR "jaxdet: JAXDET_GEMM_KERNELS entry '${entry}' must have 6 fields and at least one tile")
    endif()
    list(GET fields 0 set_name)
    list(GET fields 1 family)
    list(GET fields 2 dtype)
    list(GET fields 3 layout)
    list(GET fields 4 c)
    list(GET fields 5 d)
    list(SUBLIST fields 6 -1 tiles)
    if(set_name IN_LIST names)
      message(FATAL_ERROR "jaxdet: JAXDET_GEMM_KERNELS names ${set_name} twice")
    endif()
    list(APPEND names "${set_name}")
    string(SUBSTRING "${layout}" 0 1 la)
    string(SUBSTRING "${layout}" 1 1 lb)
    foreach(var IN ITEMS dtype c d la lb)
      if(var MATCHES "^l")
        set(key "_jaxdet_layout_${${var}}")
      else()
        set(key "_jaxdet_type_${${var}}")
      endif()
      if(NOT DEFINED ${key})
        message(FATAL_ERROR "jaxdet: JAXDET_GEMM_KERNELS entry '${entry}': unknown ${var} '${${var}}'")
      endif()
    endforeach()
    if(NOT family MATCHES "^(sm90|sm80)$")
      message(FATAL_ERROR "jaxdet: JAXDET_GEMM_KERNELS entry '${entry}': unknown family '${family}'")
    endif()
    set(stub OFF)
    if(family STREQUAL "sm90" AND NOT with_sm90)
      set(stub ON)
    endif()
    set(template_args "${_jaxdet_type_${dtype}}, ${_jaxdet_layout_${la}}, ${_jaxdet_layout_${lb}}, ${_jaxdet_type_${c}}, ${_jaxdet_type_${d}}")
    set(rows "")
    set(last_area "")
    set(impls "")
    set(JAXDET_KERNEL_LAUNCHERS "")
    foreach(tile IN LISTS tiles)
      if(NOT tile MATCHES "^([0-9]+)x([0-9]+)(:(narrow))?$")
        message(FATAL_ERROR "jaxdet: JAXDET_GEMM_KERNELS entry '${entry}': tile '${tile}' is not ROWSxCOLS[:narrow]")
      endif()
      set(tile_m "${CMAKE_MATCH_1}")
      set(tile_n "${CMAKE_MATCH_2}")
      if(CMAKE_MATCH_4)
        set(impl "${CMAKE_MATCH_4}")
      else()
        set(impl "${family}")
      endif()
      list(APPEND impls "${impl}")
      set(tile "${tile_m}x${tile_n}")
      math(EXPR area "${tile_m} * ${tile_n}")
      if(NOT last_area STREQUAL "" AND area GREATER last_area)
        message(FATAL_ERROR "jaxdet: JAXDET_GEMM_KERNELS entry '${entry}': tiles must come largest first")
      endif()
      set(last_area "${area}")
      set(kernel "${set_name}_${tile}")
      string(APPEND JAXDET_KERNEL_LAUNCHERS "
JAXDET_GEMM_LAUNCHER(${kernel}) {
  return ${impl}::launch<${template_args}, ${tile_m}, ${tile_n}>(args, stream);
}
")
      if(stub)
        string(APPEND stub_launchers "JAXDET_GEMM_SM90_STUB(${kernel})\n")
      endif()
      string(APPEND declarations
             "JAXDET_GEMM_LAUNCHER(${kernel});  // ${family} ${dtype} ${layout} C=${c} D=${d} tile ${tile}\n")
      string(APPEND rows "    {${tile_m}, ${tile_n}, ${kernel}},\n")
    endforeach()
    if(NOT stub)
      list(REMOVE_DUPLICATES impls)
      set(JAXDET_KERNEL_INCLUDES "")
      foreach(impl IN LISTS impls)
        string(APPEND JAXDET_KERNEL_INCLUDES "#include \"gemm/gemm_${impl}.cuh\"\n")
      endforeach()
      set(JAXDET_KERNEL_SET "${set_name}")
      set(source "${dir}/gemm/${set_name}.cu")
      configure_file("${template}" "${source}" @ONLY)
      list(APPEND ${family}_sources "${source}")
    endif()
    list(LENGTH tiles count)
    string(APPEND sets
           "inline constexpr TileKernel ${set_name}_tiles[] = {\n${rows}};\n"
           "inline constexpr KernelSet ${set_name}{${set_name}_tiles, ${count}};\n")
  endforeach()
  set(stub_sources "")
  if(NOT with_sm90)
    # A build without sm_90a code: the Hopper launchers exist (the dispatcher names them) and fail.
    file(CONFIGURE OUTPUT "${dir}/gemm/sm90_stubs.cc" @ONLY CONTENT
"// Generated by cuda/gemm/kernels.cmake for a build without the 90a architecture: the launchers of
// the sm90 family return an error (the dispatcher picks them on an sm_90 GPU only).
#include \"gemm/gemm_args.h\"

#define JAXDET_GEMM_SM90_STUB(name)                                                                  \\
  JAXDET_GEMM_LAUNCHER(name) {                                                                       \\
    (void)args;                                                                                      \\
    (void)stream;                                                                                    \\
    return \"this build of jaxdet has no sm_90a kernels (built for CUDA architectures \"             \\
           \"${JAXDET_CUDA_ARCHS}); rebuild with JAXDET_CUDA_ARCHS including 90a (docs/BUILDING.md)\"; \\
  }

namespace jaxdet {
namespace gemm {

${stub_launchers}
}  // namespace gemm
}  // namespace jaxdet
")
    list(APPEND stub_sources "${dir}/gemm/sm90_stubs.cc")
  endif()
  file(CONFIGURE OUTPUT "${dir}/gemm_launchers.h" @ONLY CONTENT
"// Generated by cuda/gemm/kernels.cmake from JAXDET_GEMM_KERNELS: every CUTLASS launcher of the GEMM,
// declared once (family, dtype, layout of A and B, epilogue C and D, tile), and every kernel set
// (one entry of the list: its tiles, largest first).
#pragma once

#include \"gemm/gemm_args.h\"

namespace jaxdet {
namespace gemm {

${declarations}
${sets}
}  // namespace gemm
}  // namespace jaxdet
")
  set(JAXDET_GEMM_SM90_SOURCES "${sm90_sources}" PARENT_SCOPE)
  set(JAXDET_GEMM_SM80_SOURCES "${sm80_sources}" PARENT_SCOPE)
  set(JAXDET_GEMM_STUB_SOURCES "${stub_sources}" PARENT_SCOPE)
endfunction()
