// Clang thread-safety annotations (empty on other compilers). See
// https://clang.llvm.org/docs/ThreadSafetyAnalysis.html for their meaning.
#pragma once

#if defined(__clang__) && !defined(SWIG)
#define STRATA_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define STRATA_THREAD_ANNOTATION_(x)
#endif

#define STRATA_CAPABILITY(x) STRATA_THREAD_ANNOTATION_(capability(x))
#define STRATA_SCOPED_CAPABILITY STRATA_THREAD_ANNOTATION_(scoped_lockable)
#define STRATA_GUARDED_BY(x) STRATA_THREAD_ANNOTATION_(guarded_by(x))
#define STRATA_PT_GUARDED_BY(x) STRATA_THREAD_ANNOTATION_(pt_guarded_by(x))
#define STRATA_ACQUIRED_BEFORE(...) STRATA_THREAD_ANNOTATION_(acquired_before(__VA_ARGS__))
#define STRATA_ACQUIRED_AFTER(...) STRATA_THREAD_ANNOTATION_(acquired_after(__VA_ARGS__))
#define STRATA_REQUIRES(...) STRATA_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define STRATA_EXCLUDES(...) STRATA_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
#define STRATA_ACQUIRE(...) STRATA_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define STRATA_RELEASE(...) STRATA_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
#define STRATA_TRY_ACQUIRE(...) STRATA_THREAD_ANNOTATION_(try_acquire_capability(__VA_ARGS__))
#define STRATA_RETURN_CAPABILITY(x) STRATA_THREAD_ANNOTATION_(lock_returned(x))
#define STRATA_NO_THREAD_SAFETY_ANALYSIS STRATA_THREAD_ANNOTATION_(no_thread_safety_analysis)
