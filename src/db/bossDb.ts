// pg-boss behind a transaction pooler: its statements and transactions through the pooled URL, and its
// LISTEN, which needs a session the pooler cannot keep, on the direct one (DATABASE_DIRECT_URL).
import Db from 'pg-boss/dist/db.js';
import type { DatabaseOptions } from 'pg-boss';

export class PooledBossDb extends Db {
  readonly #listener: Db;

  constructor(config: DatabaseOptions, directUrl: string) {
    super(config);
    // Its pool is never used: listen() opens a client of its own, with this configuration.
    this.#listener = new Db({ ...config, connectionString: directUrl, max: 1 });
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
