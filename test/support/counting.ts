import type { Pool } from '../../src/db/pool.ts';

/** The pool, counting every statement sent on it or on a client checked out of it. */
export function counting(pool: Pool): { pool: Pool; statements: () => number } {
  let n = 0;
  const wrapQuery = <T extends object>(target: T) =>
    new Proxy(target, {
      get(obj, prop) {
        if (prop === 'query') return (...args: unknown[]) => (n++, (obj as { query: (...a: unknown[]) => unknown }).query(...args));
        if (prop === 'connect') return async () => wrapQuery(await (obj as unknown as Pool).connect());
        const value = Reflect.get(obj, prop);
        return typeof value === 'function' ? value.bind(obj) : value;
      },
    });
  return { pool: wrapQuery(pool), statements: () => n };
}
