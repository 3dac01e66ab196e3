CREATE TABLE "outboxd"."settlement_consumption" (
	"subscriber" text NOT NULL,
	"operation_id" uuid NOT NULL,
	"consumed_at" timestamp with time zone DEFAULT now() NOT NULL,
	CONSTRAINT "settlement_consumption_subscriber_operation_id_pk" PRIMARY KEY("subscriber","operation_id")
);
