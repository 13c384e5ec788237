/* Peak rate of the instructions a few-row product could use, one core: 12 independent accumulator chains
 * each, so throughput (not latency) bounds them. Tells whether a CPU's 512-bit units are full width.
 *
 *     cc -O2 -o /tmp/simd_throughput experiments/simd_throughput.c && /tmp/simd_throughput
 *
 * vdpbf16ps zmm (32 bf16 products), vfmadd zmm (16 fp32), vfmadd ymm (8 fp32), vpdpbusd zmm (64 int8).
 * On the Zen 4 EPYC (docs/results.md): 3.5 / 3.5 / 7.2 / 3.6 G instructions/s, i.e. one 512-bit or two
 * 256-bit FMAs a cycle: 16 fp32 products a cycle either way.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N 200000000L
__attribute__((target("avx512f,avx512bf16")))
void dp(void){
  __m512 a0=_mm512_set1_ps(0),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m512bh x=(__m512bh)_mm512_set1_epi16(0x3f80), y=(__m512bh)_mm512_set1_epi16(0x3f80);
  double t=now();
  for(long i=0;i<N/12;i++){
    a0=_mm512_dpbf16_ps(a0,x,y);a1=_mm512_dpbf16_ps(a1,x,y);a2=_mm512_dpbf16_ps(a2,x,y);a3=_mm512_dpbf16_ps(a3,x,y);
    a4=_mm512_dpbf16_ps(a4,x,y);a5=_mm512_dpbf16_ps(a5,x,y);a6=_mm512_dpbf16_ps(a6,x,y);a7=_mm512_dpbf16_ps(a7,x,y);
    a8=_mm512_dpbf16_ps(a8,x,y);a9=_mm512_dpbf16_ps(a9,x,y);a10=_mm512_dpbf16_ps(a10,x,y);a11=_mm512_dpbf16_ps(a11,x,y);
    __asm__ volatile("" : "+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9),"+v"(a10),"+v"(a11));
  }
  t=now()-t; __m512 s=_mm512_add_ps(a0,a11);
  printf("dpbf16 zmm: %.3f ns/instr (%.1f Ginstr/s) %f\n",t/N*1e9,N/t/1e9,_mm512_reduce_add_ps(s));
}
__attribute__((target("avx512f")))
void fma512(void){
  __m512 a0=_mm512_set1_ps(0),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m512 x=_mm512_set1_ps(1.0f),y=_mm512_set1_ps(1e-9f);
  double t=now();
  for(long i=0;i<N/12;i++){
    a0=_mm512_fmadd_ps(x,y,a0);a1=_mm512_fmadd_ps(x,y,a1);a2=_mm512_fmadd_ps(x,y,a2);a3=_mm512_fmadd_ps(x,y,a3);
    a4=_mm512_fmadd_ps(x,y,a4);a5=_mm512_fmadd_ps(x,y,a5);a6=_mm512_fmadd_ps(x,y,a6);a7=_mm512_fmadd_ps(x,y,a7);
    a8=_mm512_fmadd_ps(x,y,a8);a9=_mm512_fmadd_ps(x,y,a9);a10=_mm512_fmadd_ps(x,y,a10);a11=_mm512_fmadd_ps(x,y,a11);
    __asm__ volatile("" : "+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9),"+v"(a10),"+v"(a11));
  }
  t=now()-t; __m512 s=_mm512_add_ps(a0,a11);
  printf("fma zmm: %.3f ns/instr (%.1f Ginstr/s) %f\n",t/N*1e9,N/t/1e9,_mm512_reduce_add_ps(s));
}
__attribute__((target("avx2,fma")))
void fma256(void){
  __m256 a0=_mm256_set1_ps(0),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m256 x=_mm256_set1_ps(1.0f),y=_mm256_set1_ps(1e-9f);
  double t=now();
  for(long i=0;i<N/12;i++){
    a0=_mm256_fmadd_ps(x,y,a0);a1=_mm256_fmadd_ps(x,y,a1);a2=_mm256_fmadd_ps(x,y,a2);a3=_mm256_fmadd_ps(x,y,a3);
    a4=_mm256_fmadd_ps(x,y,a4);a5=_mm256_fmadd_ps(x,y,a5);a6=_mm256_fmadd_ps(x,y,a6);a7=_mm256_fmadd_ps(x,y,a7);
    a8=_mm256_fmadd_ps(x,y,a8);a9=_mm256_fmadd_ps(x,y,a9);a10=_mm256_fmadd_ps(x,y,a10);a11=_mm256_fmadd_ps(x,y,a11);
    __asm__ volatile("" : "+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9),"+v"(a10),"+v"(a11));
  }
  t=now()-t; __m256 s=_mm256_add_ps(a0,a11);
  float o[8]; _mm256_storeu_ps(o,s);
  printf("fma ymm: %.3f ns/instr (%.1f Ginstr/s) %f\n",t/N*1e9,N/t/1e9,o[0]);
}
__attribute__((target("avx512f,avx512vnni")))
void vnni(void){
  __m512i a0=_mm512_set1_epi32(0),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,a8=a0,a9=a0,a10=a0,a11=a0;
  __m512i x=_mm512_set1_epi8(1),y=_mm512_set1_epi8(1);
  double t=now();
  for(long i=0;i<N/12;i++){
    a0=_mm512_dpbusd_epi32(a0,x,y);a1=_mm512_dpbusd_epi32(a1,x,y);a2=_mm512_dpbusd_epi32(a2,x,y);a3=_mm512_dpbusd_epi32(a3,x,y);
    a4=_mm512_dpbusd_epi32(a4,x,y);a5=_mm512_dpbusd_epi32(a5,x,y);a6=_mm512_dpbusd_epi32(a6,x,y);a7=_mm512_dpbusd_epi32(a7,x,y);
    a8=_mm512_dpbusd_epi32(a8,x,y);a9=_mm512_dpbusd_epi32(a9,x,y);a10=_mm512_dpbusd_epi32(a10,x,y);a11=_mm512_dpbusd_epi32(a11,x,y);
    __asm__ volatile("" : "+v"(a0),"+v"(a1),"+v"(a2),"+v"(a3),"+v"(a4),"+v"(a5),"+v"(a6),"+v"(a7),"+v"(a8),"+v"(a9),"+v"(a10),"+v"(a11));
  }
  t=now()-t;
  printf("vnni zmm: %.3f ns/instr (%.1f Ginstr/s) %d\n",t/N*1e9,N/t/1e9,_mm512_reduce_add_epi32(_mm512_add_epi32(a0,a11)));
}
int main(){dp();fma512();fma256();vnni();return 0;}
