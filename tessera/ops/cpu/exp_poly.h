/* The exp of avx512_math.h's exp16 and avx2_math.h's exp8, written once for any vector width:
 * x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so n ln2 is exact), then a degree-6
 * polynomial for exp(r) in Horner form; each caller scales by 2^n its own way. FMA, SET1 and
 * the vector type are the width's intrinsics. */
#ifndef TESSERA_EXP_POLY_H
#define TESSERA_EXP_POLY_H

#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187045e-06f

/* r = x - n ln2 */
#define EXP_REDUCE(FNMA, SET1, n, x) FNMA((n), SET1(EXP_LN2_LO), FNMA((n), SET1(EXP_LN2_HI), (x)))

/* exp(r) */
#define EXP_POLY(FMA, SET1, r)                                                              \
    FMA(FMA(FMA(FMA(FMA(FMA(SET1(1.0f / 720.0f), (r), SET1(1.0f / 120.0f)), (r),            \
                        SET1(1.0f / 24.0f)), (r), SET1(1.0f / 6.0f)), (r), SET1(0.5f)),     \
            (r), SET1(1.0f)), (r), SET1(1.0f))
#endif
