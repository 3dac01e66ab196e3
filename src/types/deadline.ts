// A bound on time for work that cannot be stopped from outside: it is given up at the deadline, not
// waited for, and what it does later is nobody's.

/** `work`'s result, or the error `expired` makes once `ms` have passed (it may also tell the work to stop). */
export async function withinDeadline<T>(work: Promise<T>, ms: number, expired: () => Error): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(expired()), ms)));
  work.catch(() => {}); // given up: a later failure has nobody left to tell
  try {
    return await Promise.race([work, late]);
  } finally {
    clearTimeout(timer);
  }
}
