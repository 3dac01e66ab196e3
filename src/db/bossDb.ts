// pg-boss's LISTEN on a session of its own at the direct URL (DATABASE_DIRECT_URL), while its statements
// and transactions go through a transaction pooler (PooledBossDb) or an application's pool (createBoss).
import Db from 'pg-boss/dist/db.js';
import type { DatabaseOptions } from 'pg-boss';

/** pg-boss's LISTEN on the direct URL: a Db whose pool is never used, since listen() opens a client of its
 * own with this configuration (reconnected on failure). */
export const directListener = (config: DatabaseOptions, directUrl: string): Db => new Db({ ...config, connectionString: directUrl, max: 1 });

export class PooledBossDb extends Db {
  readonly #listener: Db;

  constructor(config: DatabaseOptions, directUrl: string) {
    super(config);
    this.#listener = directListener(config, directUrl);
    this.#listener.on('error', (err: Error) => this.emit('error', err));
  }

  override async open(): Promise<void> {
    await super.open();
    await this.#listener.open();
  }

  override async close(): Promise<void> {
    await Promise.all([super.close(), this.#listener.close()]);
  }

  override listen(...args: Parameters<Db['listen']>): ReturnType<Db['listen']> {
    return this.#listener.listen(...args);
  }
}
